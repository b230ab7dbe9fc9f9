"""``ToolStreamer``: one choice's text deltas in, OpenAI content and ``tool_calls`` deltas out.

vLLM re-parses the whole text on every delta inside each parser
(``extract_tool_calls_streaming``); kvstack runs one generic state machine over the
parser's ``find_start`` / ``content_end`` / ``scan`` (``base.py``), so a stream says what
``extract`` says about the same text:

* content is emitted as soon as it is content for sure: a suffix that could begin the
  start marker is held back (``<tool_`` for hermes, ``[TOOL_CA`` for mistral,
  ``<|python_`` or blank text before a leading ``{`` for llama3_json, blank text before a
  leading ``[`` for pythonic), and blank text stays held until something else arrives
  (``extract``'s None-if-blank rule);
* from the start marker on, text is held. A call is emitted once its text is complete
  (``</tool_call>``, the closing brace, the ``,`` or ``]`` after a pythonic call) as two
  deltas in OpenAI's streaming shape: ``{"index": i, "id": ..., "type": "function",
  "function": {"name": ..., "arguments": ""}}`` then ``{"index": i, "function":
  {"arguments": <the whole JSON>}}`` (arguments arrive in one piece, not token by token);
* once the held text can no longer be tool calls, or at ``finish`` if it is not, it is
  emitted as content, and so is every later delta.

Then the joined content deltas equal ``extract(text).content`` (``""`` for None) and the
calls equal ``extract(text).tool_calls`` but for their ids, for every text and every way
of cutting it into deltas, with one exception that only ``eager=True`` (the default) has:
when a call was already sent and a LATER part of the region turns out malformed, the
sent calls stand and the text after the last of them is emitted as content, where
``extract`` makes the whole text content (the usual cause: ``max_tokens`` cuts the
second of two calls). ``eager=False`` holds every call until ``finish`` and then always
agrees with ``extract``.

Cost: each scan resumes after the calls already found (``pythonic`` also resumes inside
a call through ``memo``), and scans run only on deltas holding one of the parser's
``closers``, so a stream costs about linear time in its length.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvstack.serve.chat.tool_parsers.base import RawCall, ToolParser, make_tool_call_id


@dataclass(frozen=True)
class ContentDelta:
    """Text to send as ``delta.content``."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of ``delta.tool_calls``: a call's header (``id`` set) or its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


StreamEvent: TypeAlias = ContentDelta | ToolCallDelta


class ToolStreamer:
    """Per-choice streaming state over one parser (see the module docstring)."""

    def __init__(
        self, parser: ToolParser, known_names: Set[str] | None = None, eager: bool = True
    ) -> None:
        self.parser = parser
        self.known_names = known_names
        self.eager = eager
        self._text = ""
        self._sent = 0  # characters of _text emitted as content (or passed over)
        self._content_started = False  # a non-blank character was emitted
        self._start: int | None = None  # where the tool-call region begins
        self._resume = 0  # region offset to scan from (after the consumed calls)
        self._consumed_end = 0  # region offset just past the last emitted (or dropped) call
        self._held: list[RawCall] = []  # complete calls not emitted yet (eager=False)
        self._passthrough = False  # the region is content: emit everything
        self._memo: dict[int, Any] = {}  # the parser's scratch space for this region
        self._finished = False
        self.tool_calls_sent = 0  # calls emitted (finish_reason "tool_calls" when > 0)

    @property
    def text(self) -> str:
        """Everything fed so far."""
        return self._text

    def feed(self, delta: str) -> list[StreamEvent]:
        """Events for one new piece of generated text."""
        if self._finished:
            raise RuntimeError("ToolStreamer.feed after finish")
        if not delta:
            return []
        self._text += delta
        if self._passthrough:
            return self._flush()
        events: list[StreamEvent] = []
        if self._start is None:
            start = self.parser.find_start(self._text)
            if start is None:
                return self._content_upto(self.parser.content_end(self._text))
            self._start = start
            events += self._content_upto(start)
        if self.parser.worth_scanning(delta):
            events += self._advance(final=False)
        return events

    def finish(self) -> list[StreamEvent]:
        """The last events, once generation has ended; the streamer is then spent."""
        if self._finished:
            return []
        self._finished = True
        if self._passthrough or self._start is None:
            return self._flush()
        return self._advance(final=True)

    # -- internals ------------------------------------------------------------------

    def _content_upto(self, end: int) -> list[StreamEvent]:
        """Content up to ``end``, holding it while everything so far is blank."""
        if end <= self._sent:
            return []
        if not self._content_started:
            if not self._text[:end].strip():
                return []
            self._content_started = True
        piece = self._text[self._sent : end]
        self._sent = end
        return [ContentDelta(piece)]

    def _flush(self) -> list[StreamEvent]:
        """All unsent text as content (no held blank rule: ``extract`` keeps it too)."""
        piece = self._text[self._sent :]
        self._sent = len(self._text)
        return [ContentDelta(piece)] if piece else []

    def _advance(self, final: bool) -> list[StreamEvent]:
        assert self._start is not None
        region = self._text[self._start :]
        try:
            result = self.parser.scan(region, self._resume, final, self._memo)
        except (ValueError, RecursionError, MemoryError):  # defensive, as in extract
            return self._fail()
        self._held += result.calls
        self._resume = result.resume
        if result.failed or (final and not self._held and not self._consumed_end):
            return self._fail()
        if not (self.eager or final):
            return []
        events: list[StreamEvent] = []
        for call in self._held:
            events += self._emit(call)
        self._held = []
        return events

    def _emit(self, call: RawCall) -> list[StreamEvent]:
        self._consumed_end = call.end
        if self.known_names is not None and call.name not in self.known_names:
            return []
        index = self.tool_calls_sent
        self.tool_calls_sent += 1
        return [
            ToolCallDelta(index, "", id=make_tool_call_id(), name=call.name),
            ToolCallDelta(index, call.arguments),
        ]

    def _fail(self) -> list[StreamEvent]:
        """The region is not tool calls: content from here on."""
        assert self._start is not None
        self._passthrough = True
        self._held = []
        if self.tool_calls_sent:  # eager's one divergence from extract (module docstring)
            self._sent = max(self._sent, self._start + self._consumed_end)
        return self._flush()
