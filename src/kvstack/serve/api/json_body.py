"""Request bodies as JSON values, refusing what Python's parser accepts but nothing after
it can use, each as a ``BodyError`` that names where it is (``param``).

``json.loads`` (RFC 8259 plus Python's extensions) lets three things through that broke
the server later, as 500s:

- ``NaN``, ``Infinity``, ``-Infinity``, and a number literal too large for a float
  (``1e999`` parses as ``inf``): not JSON numbers, and a NaN passes every range check
  (``nan < 0`` is false);
- an integer literal longer than CPython's int-string limit
  (``sys.get_int_max_str_digits()``, 4,300 digits, CVE-2020-10735): ``json.loads`` raises
  a bare ``ValueError``;
- a string with a lone surrogate (``"\\ud800"``): valid JSON escape syntax, but not
  Unicode text: the tokenizer refuses it (``TextInputSequence must be str``), ``encode``
  raises, and an error message quoting it cannot be written as UTF-8.

Each is a 400 whose ``param`` is the dotted path to the value (``messages.0.content``,
as pydantic's error locations read), and whose message never quotes the value.

Cost: the common body parses once, with only the float hook added (floats are rare in
requests; integers, the bulk of token-id lists, keep the C parser's own conversion). The
tree is walked only when a bad literal was seen or the raw body holds a
``\\uD800``-``\\uDFFF`` escape (the only way a surrogate reaches a string: UTF-8 cannot
encode one, and the body was decoded strictly); the walk is iterative and linear.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

__all__ = ["BodyError", "load_json"]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(ValueError):
    """A body that parses but holds a value no field can take; ``param`` is its path."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class _Refused:
    """Stands in the parsed tree for a literal that must not be used, so the walk can
    say where it was."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def load_json(body: bytes) -> Any:
    """``body`` (UTF-8, strictly decoded) as a JSON value. Raises ``UnicodeDecodeError``,
    ``json.JSONDecodeError``, ``RecursionError`` as ``json.loads`` does, and
    ``BodyError`` for the values the module docstring lists."""
    text = body.decode("utf-8")
    refused: list[_Refused] = []
    long_ints: list[_Refused] = []

    def constant(name: str) -> _Refused:
        refused.append(_Refused(f"{name} is not valid JSON: numbers must be finite"))
        return refused[-1]

    def number(literal: str) -> float | _Refused:
        value = float(literal)
        if math.isfinite(value):
            return value
        refused.append(_Refused("a number too large for a float (it would be infinite)"))
        return refused[-1]

    try:
        data = json.loads(text, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError:
        raise
    except ValueError as error:  # the int-string limit: find the literal, else re-raise
        data = json.loads(
            text, parse_constant=constant, parse_float=number, parse_int=_int_hook(long_ints)
        )
        if not long_ints:
            raise error
    if refused or long_ints or _SURROGATE_ESCAPE.search(body):
        _check_tree(data)
    return data


def _int_hook(refused: list[_Refused]) -> Any:
    limit = sys.get_int_max_str_digits()

    def integer(literal: str) -> int | _Refused:
        if limit and len(literal.lstrip("-")) > limit:
            refused.append(_Refused(f"an integer literal longer than {limit} digits"))
            return refused[-1]
        return int(literal)

    return integer


def _check_tree(data: Any) -> None:
    """``BodyError`` for the first refused literal or lone surrogate in ``data``, in
    document order."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _Refused):
            raise _error(path, value.why)
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise _error(path, "a lone surrogate (\\ud800-\\udfff) is not Unicode text")
        elif isinstance(value, dict):
            items = list(value.items())
            for key, _ in items:
                if _SURROGATE.search(key):
                    raise _error((*path, _shown(key)), "a lone surrogate in a key")
            stack.extend((v, (*path, k)) for k, v in reversed(items))
        elif isinstance(value, list):
            stack.extend((v, (*path, str(i))) for i, v in reversed(list(enumerate(value))))


def _shown(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error(path: tuple[str, ...], why: str) -> BodyError:
    param = ".".join(path) or None
    return BodyError(f"{param}: {why}" if param else why, param)
