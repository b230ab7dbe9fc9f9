"""The tool-call parser contract: ``ToolParser``, its results, and the shared JSON helpers.

A parser turns one choice's generated text into OpenAI ``content`` plus ``tool_calls``, as
vLLM's ``--tool-call-parser`` does (``vllm/tool_parsers/``: ``extract_tool_calls`` for a
finished output, ``extract_tool_calls_streaming`` per delta). kvstack splits a parser into
three pure functions of the text so that one generic ``ToolStreamer`` (``streaming.py``)
serves every format and streams exactly what ``extract`` returns:

* ``find_start(text)``: where the tool-call region begins (the parser's start marker:
  ``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>`` or a leading ``{`` / ``[``), or
  None while there is none; once found in a prefix it stays the same for every longer text;
* ``content_end(text)``: with no start yet, how much of ``text`` is content whatever
  follows (a suffix that could begin the start marker is held back);
* ``scan(region, pos, final, memo)``: the calls complete in the region (text from the
  start on), read from ``pos`` (0 or an earlier ``resume``), and whether the region can no
  longer be valid tool calls; ``final`` says no more text will come. ``memo`` is scratch
  space the parser may keep between scans of one growing region (the streamer passes one
  dict per stream; only ``pythonic`` uses it); the answer never depends on it.

``extract`` (``ScanningToolParser``) is these three applied to the whole text:

* no start: ``content`` is the text, no calls;
* the region is malformed (invalid JSON, a call without a name, an unsupported form),
  or holds no call: the WHOLE text is ``content``, no calls (vLLM does the same and never
  raises; kvstack also rejects NaN/Infinity, which are not JSON);
* otherwise ``content`` is the text before the start, None when blank (vLLM's parser
  engine ``drop_whitespace_only_content_before_tools``), and text between or after calls
  is dropped, as vLLM's hermes/mistral/llama3_json parsers drop it.

``known_names``: vLLM's hermes, llama3_json, mistral and pythonic parsers do not check
names (``validate_tool_names=False``), so None (the default) keeps every call. Given a set,
calls naming a tool outside it are dropped, neither calls nor content, as vLLM's parser
engine does for parsers with ``validate_tool_names=True`` (GLM 4.7, MiniMax M2): the other
calls keep their order and are numbered from 0.

Arguments are always re-serialized with ``json.dumps(args, ensure_ascii=False)`` (vLLM's
spelling: ``{"city": "Paris"}``), and ids are ``call_`` + 24 random hex digits.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's ``{id, type: "function", function: {name, arguments}}``."""

    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedOutput:
    """A finished choice: ``content`` (None when the calls stand alone) and its calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class RawCall:
    """A call found by ``scan``: name, arguments JSON text, and where its text ends."""

    name: str
    arguments: str
    end: int  # offset in the region just past the call's text


@dataclass(frozen=True)
class ScanResult:
    """``scan``'s answer: calls complete after ``pos``, where to resume, and failure."""

    calls: list[RawCall]
    resume: int  # pass back as ``pos`` once these calls are consumed
    failed: bool = False  # the region is not valid tool calls, whatever follows


@runtime_checkable
class ToolParser(Protocol):
    """One output format of tool calls (``TOOL_PARSERS``, ``--tool-call-parser``)."""

    name: ClassVar[str]

    def extract(self, text: str, known_names: Set[str] | None = None) -> ParsedOutput:
        """The finished text as content and calls; never raises on model output."""
        ...

    def find_start(self, text: str) -> int | None:
        """Offset where the tool-call region begins, None while there is none."""
        ...

    def content_end(self, text: str) -> int:
        """With no start in ``text``: the length of its prefix that is content for sure."""
        ...

    def scan(
        self, region: str, pos: int, final: bool, memo: dict[int, Any] | None = None
    ) -> ScanResult:
        """Calls complete in ``region`` after ``pos`` (0 or an earlier ``resume``)."""
        ...

    def worth_scanning(self, delta: str) -> bool:
        """False when ``delta`` cannot complete a call (a cheap skip while streaming)."""
        ...


class ScanningToolParser(ABC):
    """``extract`` built from ``find_start`` / ``content_end`` / ``scan`` (see the module)."""

    name: ClassVar[str] = ""
    # Characters whose arrival may complete a call or reveal a malformed one; "" = any.
    closers: ClassVar[str] = ""

    @abstractmethod
    def find_start(self, text: str) -> int | None:
        """Where the calls begin in ``text``, or None."""

    @abstractmethod
    def content_end(self, text: str) -> int:
        """How much of ``text`` (no call begun) can be sent as content now."""

    @abstractmethod
    def scan(
        self, region: str, pos: int, final: bool, memo: dict[int, Any] | None = None
    ) -> ScanResult:
        """Calls complete in ``region`` after ``pos``."""

    def worth_scanning(self, delta: str) -> bool:
        return not self.closers or any(c in delta for c in self.closers)

    def extract(self, text: str, known_names: Set[str] | None = None) -> ParsedOutput:
        start = self.find_start(text)
        if start is None:
            return ParsedOutput(text)
        try:
            result = self.scan(text[start:], 0, True)
        except (ValueError, RecursionError, MemoryError):  # defensive: never fail a request
            return ParsedOutput(text)
        if result.failed or not result.calls:
            return ParsedOutput(text)
        calls = [
            ToolCall(make_tool_call_id(), c.name, c.arguments)
            for c in result.calls
            if known_names is None or c.name in known_names
        ]
        return ParsedOutput(blank_to_none(text[:start]), calls)


class MarkerToolParser(ScanningToolParser):
    """A parser whose calls begin at a fixed text, ``start_marker`` (hermes, mistral)."""

    start_marker: ClassVar[str]

    def find_start(self, text: str) -> int | None:
        i = text.find(self.start_marker)
        return None if i < 0 else i

    def content_end(self, text: str) -> int:
        """All but a tail that may be the start of the marker."""
        return len(text) - marker_overlap(text, self.start_marker)


def make_tool_call_id() -> str:
    """``call_`` + 24 random hex digits (OpenAI's shape; vLLM's ``make_tool_call_id``)."""
    return "call_" + secrets.token_hex(12)


def blank_to_none(content: str) -> str | None:
    return content if content.strip() else None


def dump_arguments(arguments: dict[str, Any]) -> str:
    """The one spelling of arguments JSON (vLLM's ``json.dumps(..., ensure_ascii=False)``)."""
    return json.dumps(arguments, ensure_ascii=False)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python's json accepts NaN and Infinity; they would re-serialize to invalid JSON.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def loads_json(text: str) -> Any:
    """Strict ``json.loads``; ``ValueError`` (or ``RecursionError``) on anything else."""
    return _DECODER.decode(text)


def decode_json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting exactly at ``text[pos]`` and its end, None if none parses.

    For an object or a list a successful decode is final: the closing bracket ends it, so
    a longer text decodes to the same value.
    """
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def coerce_arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as an object: a dict, or a string holding a JSON object; else None."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = loads_json(value)
        except (ValueError, RecursionError):
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def call_from_object(
    obj: Any, end: int, arg_keys: tuple[str, ...], missing_ok: bool
) -> RawCall | None:
    """``{"name": str, <arg key>: {...}}`` as a ``RawCall``; None if it is not one.

    The first of ``arg_keys`` present is used; with none present the arguments are ``{}``
    when ``missing_ok`` (vLLM's hermes engine), else the object is not a call.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    for key in arg_keys:
        if key in obj:
            args = coerce_arguments(obj[key]) if obj[key] is not None else {}
            break
    else:
        args = {} if missing_ok else None
    if args is None:
        return None
    return RawCall(name.strip(), dump_arguments(args), end)


def marker_overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def first_non_space(text: str) -> int | None:
    """Offset of the first non-whitespace character, None if there is none."""
    stripped = len(text) - len(text.lstrip())
    return stripped if stripped < len(text) else None
