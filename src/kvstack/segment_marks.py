"""Segment marks: which token ranges of a prompt are reusable segments (issue 18).

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstack.errors import InvalidRequestError


@dataclass(frozen=True)
class SegmentMarks:
    """A request's segments and how much of each is recomputed after placement."""

    spans: tuple[tuple[int, int], ...]
    recompute_ratio: float
    recompute_tokens: int

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


def make_marks(
    spans: Sequence[Sequence[int]],
    num_prompt_tokens: int,
    max_segment_tokens: int,
    recompute_ratio: float,
    recompute_tokens: int,
) -> SegmentMarks | None:
    """Checked marks of one prompt (None when no mark is left after the last-token cut).

    Raises ``InvalidRequestError`` for a mark that is not two integers, is empty, runs
    outside the prompt, overlaps or precedes another, or is longer than
    ``max_segment_tokens`` (what one standalone prefill may compute).
    """
    check_recompute(recompute_ratio, recompute_tokens)
    out: list[tuple[int, int]] = []
    prev_end = 0
    for i, mark in enumerate(spans):
        if (
            isinstance(mark, str | bytes)
            or len(mark) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in mark)
        ):
            raise InvalidRequestError(
                f"segment {i}: a mark is [start, end) token indices, got {mark!r}"
            )
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
    if not out:
        return None
    return SegmentMarks(tuple(out), float(recompute_ratio), recompute_tokens)
