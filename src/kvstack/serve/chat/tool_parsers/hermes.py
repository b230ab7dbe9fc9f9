"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

After vLLM's ``Hermes2ProToolParser`` (``vllm/tool_parsers/hermes_tool_parser.py`` and the
engine-backed ``vllm/parser/hermes.py``), the format of NousResearch Hermes 2 Pro and of
Qwen 2.5 / Qwen 3's templates, and of kvstack's own fallback prompt (``tool_prompt.py``):

* several blocks may follow one another; ``content`` is the text before the first one;
* the last block may lack its ``</tool_call>`` (generation stopped on the end-of-turn
  token right after the JSON), as vLLM's regex ``<tool_call>(.*)`` allows;
* a missing ``arguments`` means ``{}`` (vLLM's engine); a string holding a JSON object is
  accepted as the object; anything else in any block makes the whole text content.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvstack.serve.chat.tool_parsers.base import (
    MarkerToolParser,
    RawCall,
    ScanResult,
    call_from_object,
    loads_json,
    marker_overlap,
)

START = "<tool_call>"
END = "</tool_call>"


def _block_call(body: str, end: int) -> RawCall | None:
    try:
        obj = loads_json(body)
    except (ValueError, RecursionError):
        return None
    return call_from_object(obj, end, ("arguments",), missing_ok=True)


class HermesToolParser(MarkerToolParser):
    """``<tool_call>`` JSON blocks (Hermes 2 Pro, Qwen 2.5 / 3, kvstack's fallback)."""

    name: ClassVar[str] = "hermes"
    closers: ClassVar[str] = ">"
    start_marker: ClassVar[str] = START

    def scan(
        self, region: str, pos: int, final: bool, memo: dict[int, Any] | None = None
    ) -> ScanResult:
        calls: list[RawCall] = []
        resume = pos
        while True:
            open_at = region.find(START, resume)
            if open_at < 0:
                return ScanResult(calls, resume)
            body_at = open_at + len(START)
            close_at = region.find(END, body_at)
            if close_at < 0:
                if not final:
                    return ScanResult(calls, resume)
                body = region[body_at:]
                body = body[: len(body) - marker_overlap(body, END)]
                call = _block_call(body, len(region))
                if call is None:
                    return ScanResult(calls, resume, failed=True)
                calls.append(call)
                return ScanResult(calls, len(region))
            end = close_at + len(END)
            call = _block_call(region[body_at:close_at], end)
            if call is None:
                return ScanResult(calls, resume, failed=True)
            calls.append(call)
            resume = end
