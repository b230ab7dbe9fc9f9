"""Parsing the streamed responses of ``kvstack bench serve`` (Server-Sent Events).

A response body is a sequence of ``data: {json}`` lines ending with ``data: [DONE]``;
:class:`StreamAccumulator` folds its bytes, as they arrive and split anywhere, into the
generated text, one timestamp per chunk with text, the last ``usage`` object and the
first error. Nothing here raises on a malformed server: bad lines are counted.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from kvstack.tools.bench.report import RequestResult

DONE = "[DONE]"


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """The JSON object of an SSE ``data:`` line, :data:`DONE` for ``data: [DONE]``, None
    for any other line (blank, ``: comment``, ``event:``, ``id:``). Raises ``ValueError``
    for a ``data:`` line that is not a JSON object."""
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == DONE:
        return DONE
    obj = json.loads(payload)  # json.JSONDecodeError is a ValueError
    if not isinstance(obj, dict):
        raise ValueError(f"SSE data is not a JSON object: {payload[:80]!r}")
    return obj


def error_message(obj: Any) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``)."""
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj))
        if isinstance(err, dict):
            return str(err.get("message") or err.get("msg") or err)
        return str(err)
    return str(obj)


@dataclass
class StreamAccumulator:
    """Folds the bytes of one streamed response into text, chunk times, usage and errors.

    ``feed(data, now)`` takes bytes as they arrive (lines may be split anywhere) and the
    time they arrived; each ``data:`` line with non-empty ``choices[0].delta.content``
    (chat; also ``reasoning_content``/``reasoning``) or ``choices[0].text`` (completions)
    adds a chunk time. The last ``usage`` object seen wins. Malformed lines are counted
    and skipped. ``delta.tool_calls`` pieces are joined per call ``index`` (OpenAI's
    streaming format: the id and name come once, the arguments in pieces) into
    :attr:`tool_calls`; a chunk with such a piece counts as a chunk with text.
    ``choice_times`` has the time of *every* chunk of choice 0, even one with an empty
    delta: the TTFT of a tool request (see :meth:`fill`).
    """

    texts: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    choice_times: list[float] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str = ""
    done: bool = False  # data: [DONE] seen
    finished: bool = False  # a finish_reason seen
    malformed: int = 0
    _buffer: bytes = b""

    def feed(self, data: bytes, now: float) -> None:
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        for raw in lines:
            self._line(raw, now)

    def close(self, now: float) -> None:
        """End of the body: parse a last line without its newline."""
        if self._buffer:
            raw, self._buffer = self._buffer, b""
            self._line(raw, now)

    def _line(self, raw: bytes, now: float) -> None:
        if self.done:
            return
        try:
            event = parse_sse_line(raw.decode("utf-8", errors="replace"))
        except ValueError:
            self.malformed += 1
            return
        if event is None:
            return
        if isinstance(event, str):
            self.done = True
            return
        if event.get("error"):
            self.error = self.error or f"stream error: {error_message(event)}"
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            self.choice_times.append(now)
            delta = choice.get("delta")
            pieces = False
            if isinstance(delta, dict):
                text = (
                    delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                )
                pieces = self._tool_pieces(delta.get("tool_calls"))
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self.texts.append(text)
            if (isinstance(text, str) and text) or pieces:
                self.chunk_times.append(now)
            if choice.get("finish_reason"):
                self.finished = True
                self.finish_reason = str(choice["finish_reason"])

    def _tool_pieces(self, pieces: Any) -> bool:
        """Fold ``delta.tool_calls`` into :attr:`calls`; whether there was one."""
        if not isinstance(pieces, list):
            return False
        for piece in pieces:
            if not isinstance(piece, dict):
                continue
            index = piece.get("index", 0)
            call = self.calls.setdefault(
                index if isinstance(index, int) else 0,
                {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
            )
            if piece.get("id"):
                call["id"] = piece["id"]
            function = piece.get("function")
            if isinstance(function, dict):
                if function.get("name"):
                    call["function"]["name"] = function["name"]
                if isinstance(function.get("arguments"), str):
                    call["function"]["arguments"] += function["arguments"]
        return bool(pieces)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The streamed calls in index order (OpenAI ``tool_calls`` of a message)."""
        return [self.calls[i] for i in sorted(self.calls)]

    def fill(self, result: RequestResult, start: float, every_chunk: bool = False) -> None:
        """Set ``result``'s text, tool calls, finish reason, TTFT, ITLs and usage fields
        (times relative to ``start``). With ``every_chunk`` (requests with tools) TTFT and
        ITLs come from every chunk: a forced call's JSON arrives in one delta at the end
        (kvstack holds it until it parses), while kvstack and vLLM send the first chunk
        (the role) with the first sampled token and one chunk per token after it."""
        times = self.choice_times if every_chunk else self.chunk_times
        result.generated_text = "".join(self.texts)
        result.tool_calls = self.tool_calls
        result.finish_reason = self.finish_reason
        result.num_chunks = len(self.chunk_times)
        result.ttft = times[0] - start if times else None
        result.itl = [b - a for a, b in itertools.pairwise(times)]
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")

        def count(value: Any) -> int | None:
            is_int = isinstance(value, int) and not isinstance(value, bool)
            return value if is_int else None

        result.prompt_tokens = count(usage.get("prompt_tokens"))
        result.completion_tokens = count(usage.get("completion_tokens"))
        if isinstance(details, dict):
            result.cached_tokens = count(details.get("cached_tokens"))
