"""``pythonic``: ``[get_weather(city="Paris"), get_time()]``, read with ``ast``, never run.

After vLLM's ``PythonicToolParser`` (``vllm/tool_parsers/pythonic_tool_parser.py``), the
format of Llama 3.2 / 4 pythonic templates and of ToolACE:

* the whole output (surrounding whitespace allowed; vLLM allows none) is one Python list
  of calls, so ``content`` is always None when there are calls;
* each element is ``name(kw=literal, ...)``: a plain name, keyword arguments only (vLLM
  silently drops positional ones; here they make the output not a call), and values that
  are literals: strings, finite numbers (a leading ``-`` allowed), ``True`` / ``False`` /
  ``None``, and lists, tuples and dicts with string keys of those;
* anything else (an attribute call, a variable, an f-string, an expression, a comment, text
  after the list) means the output is not tool calls and is all content.

``ast.parse`` only builds a syntax tree; nothing is evaluated or imported. Each element is
cut out by a bracket- and string-aware scan, so a stream can emit a call as soon as the
``,`` or ``]`` after it arrives.
"""

from __future__ import annotations

import ast
import math
from typing import Any, ClassVar

from kvstack.serve.tool_parsers.base import (
    RawCall,
    ScanningToolParser,
    ScanResult,
    dump_arguments,
    first_non_space,
)

_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = set(_OPEN.values())
_SPACE = " \t\r\n"
INCOMPLETE = -1
INVALID = -2


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal node; ``_NotLiteral`` for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral(type(value).__name__)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = node.operand
        if (
            isinstance(operand, ast.Constant)
            and isinstance(operand.value, int | float)
            and not isinstance(operand.value, bool)
            and math.isfinite(operand.value)
        ):
            return -operand.value if isinstance(node.op, ast.USub) else operand.value
        raise _NotLiteral("unary operator")
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral("dict key")
            out[key.value] = _literal(item)
        return out
    raise _NotLiteral(type(node).__name__)


def parse_call(source: str, end: int) -> RawCall | None:
    """``name(kw=literal, ...)`` as a ``RawCall``; None for anything else."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
        call = tree.body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        args = {}
        for kw in call.keywords:
            if kw.arg is None:  # **kwargs
                return None
            args[kw.arg] = _literal(kw.value)
        return RawCall(call.func.id, dump_arguments(args), end)
    except (_NotLiteral, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _string_end(text: str, i: int) -> int:
    """Offset just past the string literal whose quote is at ``text[i]``."""
    q = text[i]
    if i + 2 >= len(text) and text[i + 1 : i + 3] == q * len(text[i + 1 : i + 3]):
        return INCOMPLETE  # '' or ' at the end: an empty string or a triple quote
    delim = q * 3 if text.startswith(q * 3, i) else q
    k = i + len(delim)
    while k < len(text):
        c = text[k]
        if c == "\\":
            k += 2
            continue
        if text.startswith(delim, k):
            return k + len(delim)
        if c == "\n" and len(delim) == 1:
            return INVALID
        k += 1
    return INCOMPLETE


def element_end(text: str, i: int) -> int:
    """Offset of the ``,`` or ``]`` ending the list element at ``text[i]``.

    ``INCOMPLETE`` while the text runs out first, ``INVALID`` for mismatched brackets or a
    ``#`` comment (which ``pythonic`` does not accept).
    """
    stack: list[str] = []
    k = i
    while k < len(text):
        c = text[k]
        if c in "'\"":
            k = _string_end(text, k)
            if k < 0:
                return k
            continue
        if c == "#":
            return INVALID
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in _CLOSE:
            if stack:
                if stack.pop() != c:
                    return INVALID
            elif c == "]":
                return k
            else:
                return INVALID
        elif c == "," and not stack:
            return k
        k += 1
    return INCOMPLETE


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


class PythonicToolParser(ScanningToolParser):
    """A Python list of calls with literal keyword arguments."""

    name: ClassVar[str] = "pythonic"
    closers: ClassVar[str] = ",]"

    def find_start(self, text: str) -> int | None:
        first = first_non_space(text)
        return first if first is not None and text[first] == "[" else None

    def content_end(self, text: str) -> int:
        return 0 if first_non_space(text) is None else len(text)

    def scan(self, region: str, pos: int, final: bool) -> ScanResult:
        """From ``pos`` 0 (the ``[``) or a ``resume``: the ``,`` or ``]`` after a call."""
        calls: list[RawCall] = []
        resume = pos
        i = pos if pos else 1
        want_call = pos == 0  # at a resume point a separator comes first
        while True:
            i = _skip_space(region, i)
            if i >= len(region):
                return ScanResult(calls, resume, failed=final)
            c = region[i]
            if c == "]" and (not want_call or pos or calls):  # "[f(),]" is a list too
                failed = bool(region[i + 1 :].strip())
                return ScanResult(calls, resume, failed=failed)
            if not want_call:
                if c != ",":
                    return ScanResult(calls, resume, failed=True)
                want_call = True
                i += 1
                continue
            if not (c.isidentifier() or c == "_"):
                return ScanResult(calls, resume, failed=True)  # "[]", "[1, 2]", "[x", ...
            end = element_end(region, i)
            if end == INCOMPLETE:
                return ScanResult(calls, resume, failed=final)
            call = parse_call(region[i:end], end) if end >= 0 else None
            if call is None:
                return ScanResult(calls, resume, failed=True)
            calls.append(call)
            i = resume = end
            want_call = False
