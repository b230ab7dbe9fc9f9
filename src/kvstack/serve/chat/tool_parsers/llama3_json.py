"""``llama3_json``: ``[<|python_tag|>]{"name": ..., "parameters": {...}}; {...}``.

After vLLM's ``Llama3JsonToolParser`` (``vllm/entrypoints/openai/tool_parsers/
llama_tool_parser.py``; engine-backed ``vllm/parser/llama_json.py``), the JSON tool format
of Llama 3.1 / 3.2 / 4 (``examples/tool_chat_template_llama3.1_json.jinja``):

* the calls start at ``<|python_tag|>`` or at a ``{`` that is the output's first
  non-blank character (vLLM's streaming rule; a ``{`` after prose is prose);
* one or more objects, separated by ``;``, whitespace or another ``<|python_tag|>``; each
  needs a string ``name`` and an object ``arguments`` or ``parameters`` (``arguments``
  wins when both are there, as in vLLM's non-streaming path);
* text after the last object is dropped; the text before ``<|python_tag|>`` is content
  (vLLM's engine parser; the legacy one dropped it).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvstack.serve.chat.tool_parsers.base import (
    RawCall,
    ScanningToolParser,
    ScanResult,
    call_from_object,
    decode_json_at,
    first_non_space,
    marker_overlap,
)

TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class Llama3JsonToolParser(ScanningToolParser):
    """Llama 3.x JSON tool calls, optionally after ``<|python_tag|>``."""

    name: ClassVar[str] = "llama3_json"
    closers: ClassVar[str] = "}"

    def find_start(self, text: str) -> int | None:
        first = first_non_space(text)
        if first is not None and text[first] == "{":
            return first
        i = text.find(TAG)
        return None if i < 0 else i

    def content_end(self, text: str) -> int:
        if first_non_space(text) is None:
            return 0  # blank so far: a leading "{" may still come
        return len(text) - marker_overlap(text, TAG)

    def scan(
        self, region: str, pos: int, final: bool, memo: dict[int, Any] | None = None
    ) -> ScanResult:
        calls: list[RawCall] = []
        resume = pos
        i = len(TAG) if pos == 0 and region.startswith(TAG) else pos
        n = len(region)
        while True:
            while i < n:
                if region[i] in _SEPARATORS:
                    i += 1
                elif region.startswith(TAG, i):
                    i += len(TAG)
                else:
                    break
            if i >= n:
                break
            if region[i] != "{":
                if not final and TAG.startswith(region[i:]):
                    break  # maybe a separating <|python_tag|> still arriving
                if pos == 0 and not calls:
                    return ScanResult(calls, resume, failed=True)  # e.g. python code
                break  # trailing text after the calls: dropped
            decoded = decode_json_at(region, i)
            if decoded is None:
                if final:
                    return ScanResult(calls, resume, failed=True)
                break  # incomplete (or invalid: decided when the text is final)
            obj, end = decoded
            call = call_from_object(obj, end, ("arguments", "parameters"), missing_ok=False)
            if call is None:
                return ScanResult(calls, resume, failed=True)
            calls.append(call)
            i = resume = end
        failed = final and pos == 0 and not calls
        return ScanResult(calls, resume, failed)
