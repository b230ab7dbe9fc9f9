"""The reasoning parser contract: a ``<think>…</think>`` output split into reasoning and content.

vLLM's ``--reasoning-parser`` (``vllm/reasoning/``) moves a reasoning model's thinking out
of ``content`` into the message's ``reasoning`` field (vLLM's current name; older vLLM
called it ``reasoning_content``). A parser here is a pair of markers and one rule for
where reasoning starts, applied by one function to a finished text (``split``) and by one
state machine to a stream (``ReasoningStream``), so the deltas of a stream always join to
exactly what ``split`` says of the same text, however it is cut (the property the tests
check on every cut of recorded outputs):

* ``opens_in_prompt`` (DeepSeek-R1): the chat template may already have written ``<think>``
  into the prompt, so the output is reasoning from its first character (a leading
  ``<think>`` is dropped) up to ``</think>``; with no ``</think>`` all of it is reasoning;
* otherwise (Qwen3): reasoning only when the output itself opens with ``<think>`` (after
  blank text); it runs to ``</think>``, or to the end of an output cut short. An output
  that does not open with ``<think>`` (``enable_thinking: false``) is all content.

Content is what follows ``</think>`` as is (the ``\\n\\n`` the templates write after it
included, as vLLM leaves it); an empty content or reasoning is None. vLLM's
Qwen3 parser, unlike this one, calls an unclosed ``<think>`` content when not streaming and
reasoning when streaming; kvstack gives reasoning both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    """A finished output: ``reasoning`` (None if none) and ``content`` (None if empty)."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """Markers and the rule of one family (subclasses set the class variables)."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    opens_in_prompt: ClassVar[bool] = False

    def split(self, text: str) -> ReasoningSplit:
        """Reasoning and content of a finished output (never raises)."""
        stream = ReasoningStream(self)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        return ReasoningSplit((r1 + r2) or None, (c1 + c2) or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def template_markers_missing(self, template: str) -> list[str]:
        """The markers this parser reads that ``template`` never writes (the check that
        the parser fits the model: a template that never mentions ``</think>`` cannot
        belong to a model that thinks in those tags)."""
        return [m for m in (self.start, self.end) if m not in template]


def _overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """One choice's split while it streams: ``feed(delta)`` -> (reasoning, content) deltas.

    States: ``head`` (deciding whether the output opens with the start marker: blank
    text and a prefix of the marker are held), ``think`` (reasoning; a suffix that may
    begin the end marker is held), ``content``. ``finish`` flushes what is held by the
    rules of ``split``.
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self.p = parser
        self.state = "head"
        self.held = ""
        self.reasoning_text = ""  # everything emitted as reasoning so far

    def feed(self, delta: str) -> tuple[str, str]:
        reasoning, content = "", ""
        text = self.held + delta
        self.held = ""
        while text:
            if self.state == "head":
                body = text.lstrip()
                if body.startswith(self.p.start):
                    text, self.state = body[len(self.p.start) :], "think"
                elif self.p.start.startswith(body):  # blank, or a prefix of the marker
                    self.held = text
                    text = ""
                else:
                    self.state = "think" if self.p.opens_in_prompt else "content"
            elif self.state == "think":
                i = text.find(self.p.end)
                if i >= 0:
                    reasoning += text[:i]
                    text, self.state = text[i + len(self.p.end) :], "content"
                else:
                    keep = _overlap(text, self.p.end)
                    reasoning += text[: len(text) - keep]
                    self.held, text = text[len(text) - keep :], ""
            else:
                content += text
                text = ""
        self.reasoning_text += reasoning
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "head":
            if self.p.opens_in_prompt and held.strip():
                self.reasoning_text += held
                return held, ""
            return "", held if held.strip() else ""
        if self.state == "think":  # cut short inside the reasoning: a partial end marker
            self.reasoning_text += held
            return held, ""
        return "", held

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far is still reasoning (no end marker seen yet)."""
        return self.state in ("head", "think")
