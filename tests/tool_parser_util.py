"""Shared checks of the tool-call parser tests (``serve/tool_parsers``): stream a text
through ``ToolStreamer`` in chunks and compare with ``extract``."""

from __future__ import annotations

import json
import random
import re

from kvstack.serve.chat.tool_parsers import (
    ContentDelta,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    tool_parser,
)

Call = tuple[str, dict]


def calls_of(parsed_calls: list) -> list[Call]:
    return [(c.name, json.loads(c.arguments)) for c in parsed_calls]


def stream(
    parser: ToolParser,
    chunks: list[str],
    known: set[str] | None = None,
    eager: bool = True,
) -> tuple[str, list[Call], ToolStreamer]:
    """Feed ``chunks``; the joined content and the calls assembled from the deltas."""
    streamer = ToolStreamer(parser, known_names=known, eager=eager)
    events = [e for c in chunks for e in streamer.feed(c)] + streamer.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    headers: list[ToolCallDelta] = []
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index == len(headers) and e.arguments == "" and e.name
                assert re.fullmatch(r"call_[0-9a-f]{24}", e.id)
                headers.append(e)
                args[e.index] = ""
            else:
                assert e.index in args, "arguments before the call's header"
                args[e.index] += e.arguments
    assert streamer.tool_calls_sent == len(headers)
    calls = [(h.name or "", json.loads(args[h.index])) for h in headers]
    return content, calls, streamer


def cuttings(text: str, seed: int = 0) -> list[list[str]]:
    """Whole, char by char, and random chunk sizes (1-8) under three seeds."""
    cuts = [[text], list(text)]
    for s in range(3):
        rng = random.Random(seed * 31 + s)
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            chunks.append(text[i : i + n])
            i += n
        cuts.append(chunks)
    return cuts


def assert_streams_like_extract(
    name: str, text: str, known: set[str] | None = None, eager_too: bool = True
) -> None:
    parser = tool_parser(name)
    want = parser.extract(text, known)
    want_content, want_calls = want.content or "", calls_of(want.tool_calls)
    for seed, chunks in enumerate(cuttings(text)):
        modes = (False, True) if eager_too else (False,)
        for eager in modes:
            content, calls, _ = stream(parser, chunks, known, eager)
            assert (content, calls) == (want_content, want_calls), (name, text, chunks, eager, seed)
