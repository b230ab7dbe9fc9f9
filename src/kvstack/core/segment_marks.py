"""Segment marks: which token ranges of a prompt are reusable segments.

A segment is a run of prompt tokens a client marked as reusable wherever it sits: a tool
schema, a document, a content part with ``"kvstack_segment": true``. Its KV is computed
once standalone and placed at any offset (``kv/segments.py``, ``sched/segments.py``).
This module only holds and checks the marks; it knows nothing of blocks.

Marks are half-open token ranges ``[start, end)`` of the prompt, sorted, not overlapping,
not empty. The last prompt token is never inside a segment (it is always computed, so
there are logits to sample from): a mark that reaches it is cut one token short, and a
mark left empty by that cut is dropped::

    prompt:  s0 s1 [t0 t1 t2] u0 [d0 d1 d2 d3] q0 q1
                    segment 0     segment 1      computed after them

Repair (CacheBlend, Yao et al., EuroSys 2025; EPIC, Hu et al., ICML 2025): of each
placed segment, the first ``recompute_tokens`` tokens are recomputed (EPIC's fixed
first-k) and ``recompute_ratio`` of the rest, the tokens whose layer-1 KV deviates most
from the standalone copy (CacheBlend's selection); ratio 1.0 recomputes every token and
equals a full prefill.

A mark may carry a *primer* as its third element, ``[start, end, primer_ids]``: the
segment's entry is then computed standalone as ``[BOS][primer][segment]`` instead of
``[BOS][segment]`` (the server gives each tool the template's rendering of an example
tool: ``serve/chat/segment_primers.py``). The primer is part of the entry's key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstack.core.errors import InvalidRequestError


@dataclass(frozen=True)
class SegmentMarks:
    """A request's segments and how much of each is recomputed after placement."""

    spans: tuple[tuple[int, int], ...]
    recompute_ratio: float
    recompute_tokens: int
    primers: tuple[tuple[int, ...], ...] = ()  # per span (empty: none at all)

    def primer(self, i: int) -> tuple[int, ...]:
        """The tokens segment ``i`` is computed after (besides the sink); () for none."""
        return self.primers[i] if self.primers else ()

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)


def check_recompute(ratio: float, tokens: int) -> None:
    """``InvalidRequestError`` for a ratio outside [0, 1] or a negative token count."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
        raise InvalidRequestError(f"segment_recompute_ratio must be in [0, 1], got {ratio!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidRequestError(
            f"segment_recompute_tokens must be a non-negative integer, got {tokens!r}"
        )


MAX_PRIMER_TOKENS = 512


def _primer(i: int, mark: Sequence[Any], vocab_size: int | None) -> tuple[int, ...]:
    """A mark's checked primer (its optional third element)."""
    if len(mark) < 3:
        return ()
    p = mark[2]
    if (
        isinstance(p, str | bytes)
        or not isinstance(p, Sequence)
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p)
    ):
        raise InvalidRequestError(f"segment {i}: a primer is a list of token ids, got {p!r}")
    if len(p) > MAX_PRIMER_TOKENS:
        raise InvalidRequestError(
            f"segment {i}: a primer may have at most {MAX_PRIMER_TOKENS} tokens, got {len(p)}"
        )
    if vocab_size is not None and any(x >= vocab_size for x in p):
        raise InvalidRequestError(f"segment {i}: a primer token id is not below {vocab_size}")
    return tuple(int(x) for x in p)


def make_marks(
    spans: Sequence[Sequence[Any]],
    num_prompt_tokens: int,
    max_segment_tokens: int,
    recompute_ratio: float,
    recompute_tokens: int,
    vocab_size: int | None = None,
) -> SegmentMarks | None:
    """Checked marks of one prompt (None when no mark is left after the last-token cut).

    Raises ``InvalidRequestError`` for a mark that is not two integers (and an optional
    primer), is empty, runs outside the prompt, overlaps or precedes another, or is
    longer than ``max_segment_tokens`` (what one standalone prefill may compute; a
    primer that does not fit is dropped by the engine, ``engine/segments.py``).
    """
    check_recompute(recompute_ratio, recompute_tokens)
    out: list[tuple[int, int]] = []
    primers: list[tuple[int, ...]] = []
    prev_end = 0
    for i, mark in enumerate(spans):
        if (
            isinstance(mark, str | bytes)
            or not isinstance(mark, Sequence)
            or len(mark) not in (2, 3)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in mark[:2])
        ):
            raise InvalidRequestError(
                f"segment {i}: a mark is [start, end) token indices (and an optional "
                f"primer), got {mark!r}"
            )
        primer = _primer(i, mark, vocab_size)
        start, end = int(mark[0]), int(mark[1])
        if start >= end:
            raise InvalidRequestError(f"segment {i}: [{start}, {end}) is empty")
        if start < 0 or end > num_prompt_tokens:
            raise InvalidRequestError(
                f"segment {i}: [{start}, {end}) is outside the prompt of {num_prompt_tokens} tokens"
            )
        if start < prev_end:
            raise InvalidRequestError(
                f"segment {i}: [{start}, {end}) overlaps or precedes the segment before it"
            )
        if end - start > max_segment_tokens:
            raise InvalidRequestError(
                f"segment {i} has {end - start} tokens; a segment may have at most "
                f"{max_segment_tokens} (it is computed standalone in one step)"
            )
        prev_end = end
        end = min(end, num_prompt_tokens - 1)  # the last prompt token is always computed
        if start < end:
            out.append((start, end))
            primers.append(primer)
    if not out:
        return None
    kept = tuple(primers) if any(primers) else ()
    return SegmentMarks(tuple(out), float(recompute_ratio), recompute_tokens, kept)
