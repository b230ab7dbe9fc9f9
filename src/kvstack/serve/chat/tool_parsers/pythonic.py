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
cut out by a bracket- and string-aware scan (``pyscan.py``, resumable through the
streamer's ``memo``), so a stream emits a call as soon as the ``,`` or ``]`` after it
arrives, and long arguments cost linear time.
"""

from __future__ import annotations

import ast
import math
import warnings
from typing import Any, ClassVar

from kvstack.serve.chat.tool_parsers.base import (
    RawCall,
    ScanningToolParser,
    ScanResult,
    dump_arguments,
    first_non_space,
)
from kvstack.serve.chat.tool_parsers.pyscan import INCOMPLETE, ElementScan, run

_SPACE = " \t\r\n"


class _NotLiteral(Exception):
    """A node that is not a literal (the output is then content, not a call)."""


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
        # In brackets, as in the list: a newline before "(" is no statement end. Invalid
        # escapes in model text ("\\s") would warn on every parse: not the caller's concern.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse("(" + source + ")", mode="eval")
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


def _element(region: str, i: int, memo: dict[int, Any] | None) -> tuple[int, RawCall | None]:
    """(end, call) of the element at ``region[i]``, resuming an unfinished scan in ``memo``.

    A finished element is not kept: the caller's ``resume`` moves past it (or the region
    failed), so no later scan asks for it again.
    """
    scan = memo.pop(i, None) if memo is not None else None
    if not isinstance(scan, ElementScan):
        scan = ElementScan(i)
    end = run(region, scan)
    if end == INCOMPLETE:
        if memo is not None:
            memo[i] = scan
        return end, None
    return end, (parse_call(region[i:end], end) if end >= 0 else None)


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

    def scan(
        self, region: str, pos: int, final: bool, memo: dict[int, Any] | None = None
    ) -> ScanResult:
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
            end, call = _element(region, i, memo)
            if end == INCOMPLETE:
                return ScanResult(calls, resume, failed=final)
            if call is None:
                return ScanResult(calls, resume, failed=True)
            calls.append(call)
            i = resume = end
            want_call = False
