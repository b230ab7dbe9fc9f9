"""``mistral``: ``[TOOL_CALLS]`` then a JSON list, or ``[TOOL_CALLS]name[ARGS]{...}``.

After vLLM's ``MistralToolParser`` (``vllm/tool_parsers/mistral_tool_parser.py``), which
reads the two generations of Mistral's format; vLLM picks one from the tokenizer version,
kvstack (which has no tokenizer here) from the text after each ``[TOOL_CALLS]``:

* before v11 (Mistral 7B v0.3): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
  text after the list is ignored (vLLM's ``raw_decode``);
* v11 and later (Mistral Small 3.x, Magistral, Devstral, Ministral 3):
  ``[TOOL_CALLS]name{args}`` per call; HF tokenizers print ``[ARGS]`` between name and
  arguments (vLLM strips it), and v11 may add ``[CALL_ID]id`` after the name (ignored:
  kvstack issues its own ids). A name is letters, digits, ``_``, ``-`` and ``.``.

``content`` is the text before the first ``[TOOL_CALLS]``. Unlike vLLM, whose v11 path
keeps malformed arguments verbatim as a call, arguments must be a JSON object here, else
the whole text is content (the rule of every kvstack parser).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from kvstack.serve.chat.tool_parsers.base import (
    MarkerToolParser,
    RawCall,
    ScanResult,
    call_from_object,
    decode_json_at,
    dump_arguments,
)

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_LIST_START = re.compile(r"\[\s*[{\]]")
_SPACE = " \t\r\n"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _list_calls(region: str, i: int, final: bool) -> tuple[list[RawCall], int] | None:
    """The pre-v11 list at ``region[i]``: (calls, end); ([], -1) while incomplete."""
    decoded = decode_json_at(region, i)
    if decoded is None:
        return None if final else ([], -1)
    items, end = decoded
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        call = call_from_object(item, end, ("arguments",), missing_ok=True)
        if call is None:
            return None
        calls.append(call)
    return calls, end


def _named_call(region: str, i: int, final: bool) -> tuple[list[RawCall], int] | None:
    """The v11 ``name[CALL_ID]id[ARGS]{...}`` at ``region[i]``: like ``_list_calls``."""
    brace = region.find("{", i)
    if brace < 0:
        return None if final else ([], -1)
    name = region[i:brace].split(CALL_ID, 1)[0].replace(ARGS, "").strip()
    if not _NAME.fullmatch(name):
        return None
    decoded = decode_json_at(region, brace)
    if decoded is None:
        return None if final else ([], -1)
    args, end = decoded
    if not isinstance(args, dict):
        return None
    return [RawCall(name, dump_arguments(args), end)], end


class MistralToolParser(MarkerToolParser):
    """Mistral's ``[TOOL_CALLS]`` calls, both the list and the per-call form."""

    name: ClassVar[str] = "mistral"
    closers: ClassVar[str] = "}]"
    start_marker: ClassVar[str] = START

    def scan(
        self, region: str, pos: int, final: bool, memo: dict[int, Any] | None = None
    ) -> ScanResult:
        calls: list[RawCall] = []
        resume = pos
        while True:
            at = region.find(START, resume)
            if at < 0:
                return ScanResult(calls, resume)
            i = _skip_space(region, at + len(START))
            rest = region[i:]
            if not rest or (rest[0] == "[" and not rest[1:].strip()):
                # Nothing to decide on yet ("[" may open a list or "[ARGS]").
                return ScanResult(calls, resume, failed=final)
            if _LIST_START.match(rest):
                found = _list_calls(region, i, final)
            else:
                found = _named_call(region, i, final)
            if found is None:
                return ScanResult(calls, resume, failed=True)
            new, end = found
            if end < 0:
                return ScanResult(calls, resume)
            calls.extend(new)
            resume = end
