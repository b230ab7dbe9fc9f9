"""The scheduler's decision for one step: the contract between scheduler and runner.

Everything here is plain Python (no torch). The runner turns it into tensors.

For each scheduled request the step computes KV for tokens
``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` of
``request.all_token_ids``::

    all_token_ids:  t0 t1 t2 ... t(c-1) | tc ... t(c+n-1) | (not yet)
                    <-- in the cache --> <-- this step --->
    positions:                             c ... c+n-1
    slot of position p: block_ids[p // block_size] * block_size + p % block_size

The request samples a token this step iff ``c + n == request.num_tokens``.

Speculative decoding (``spec/``): a decoding request may carry ``draft_token_ids``, the
proposer's guesses, as extra rows after its last token. They count in ``n`` (and in the
step's token budget) and get KV slots, but are not in ``all_token_ids``::

    all_token_ids:  t0 ... t(N-2) | t(N-1) | d1 d2 d3        (N = num_tokens, 3 drafts)
                    <- in cache -> <------ this step ------>
    positions:                      N-1      N  N+1 N+2
    logits row j predicts position N + j: row 0 checks d1, ..., row 3 is the bonus

The request then samples (``samples``) when ``c + n == num_tokens + len(draft)``.

Segments (segment reuse, ``sched/segments.py``): before the step's forward the runner copies
each ``SegmentImport`` (standalone KV, keys re-rotated to their new positions) into the
request's slots ``[dst_start, dst_start + length)``, which end at ``c``; ``recompute``
then names positions before ``c`` whose KV the step computes again (repair), as extra
rows after every chunk of the step::

    all_token_ids:  p0 p1 | x0 x1 x2 x3 | q0 q1 q2
                    cache   imported      this step's chunk (c = 6)
    recompute:              x0    x2       two more rows, positions 2 and 4
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstack.core.request import Request


@dataclass(frozen=True)
class SegmentImport:
    """Copy ``length`` tokens of a segment entry's KV from slot ``src_start`` of its
    blocks to the request's position ``dst_start`` (keys re-rotated from position
    ``src_shift + src_start + i``: the entry's blocks start after a shared lead's)."""

    src_block_ids: tuple[int, ...]
    src_start: int
    dst_start: int
    length: int
    src_shift: int = 0


@dataclass(frozen=True)
class RecomputeSpan:
    """Repair of a placed segment ``[start, end)``: its first ``first`` tokens are
    recomputed, and ``count`` more of the rest, chosen by the runner (the tokens whose
    layer-1 KV deviates most from the copy: CacheBlend)."""

    start: int
    end: int
    first: int
    count: int


def recompute_rows(spans: list[RecomputeSpan]) -> int:
    """Rows the repair of ``spans`` adds: each span's first tokens and ``count`` more."""
    return sum(min(r.first, r.end - r.start) + r.count for r in spans)


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # snapshot taken when scheduled (the request's field moves on)
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table (covers computed + new tokens)
    # Hybrid KV manager (kv/hybrid.py): every KV group's table (block_ids is group 0's).
    group_block_ids: list[list[int]] | None = field(default=None, kw_only=True)
    # Speculative decoding: the last num_new_tokens rows' inputs are these guesses.
    draft_token_ids: list[int] = field(default_factory=list)
    # Segment reuse: KV copied in before the forward, and positions recomputed.
    segment_imports: list[SegmentImport] = field(default_factory=list)
    recompute: list[RecomputeSpan] = field(default_factory=list)

    @property
    def num_recompute_rows(self) -> int:
        return recompute_rows(self.recompute)

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence, so a token is sampled."""
        end = self.request.num_tokens + len(self.draft_token_ids)
        return self.num_computed_tokens + self.num_new_tokens == end


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests finished (aborted, stopped, rejected) since the previous step.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_recompute_rows for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
