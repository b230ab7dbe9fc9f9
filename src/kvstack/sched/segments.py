"""SegmentPlanner: the scheduler's side of segment reuse (``kv/segments.py``).

A request with segments (``Request.segments``) goes through three stages:

1. **Admission** (``prepare``): every segment must have a ready entry in the
   ``SegmentCache``. A missing one is reserved and computed standalone in this step as
   a *fill*: a ``ScheduledRequest`` of a request the scheduler never tracks, tokens
   ``[sink][primer][segment]`` at positions ``0 ..`` in the entry's blocks, that samples
   nothing (the primer: the mark's optional third element, ``serve/chat/segment_primers.py``).
   The request waits (keeping its place in the queue) until its entries are ready, the
   step after; then it holds each entry (``users``) until it has copied it, so no
   eviction can change what it computes.
2. **Placement** (``place`` / ``commit``): when the request's next token to compute is
   the start of a segment (or inside one, after a prefix hit), the segment's KV is
   copied in (``SegmentImport``) and the request jumps past it; the segments after it
   are copied in the same step, and the few tokens between two of them (a template's
   separators) run as rows of that step's forward, like repair rows (each sees every
   key before it). A chunk never runs into a segment that can still be copied::

       prompt:   p0 p1 p2 | x0 x1 x2 | g0 | y0 y1 | q0 q1 q2
       steps:    compute    copy       row   copy    compute (+ repair rows of x and y)
                 step 1     ------------------ step 2 --------------------------------

3. **Repair**: the step that copies also recomputes, as extra rows, each copied
   segment's first ``recompute_tokens`` tokens (EPIC) and ``recompute_ratio`` of the
   rest (``RecomputeSpan``; the runner picks them by layer-1 KV deviation: CacheBlend).
   Those rows and the chunk after the segments run in one forward, so every later
   token attends to the repaired KV.

A segment without a usable entry at its turn (the cache was reset) is computed in place,
exactly. Once a segment is copied, the request's later blocks are not a true prefix:
``Request.cacheable_tokens`` stops prefix-cache registration at the first copy.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstack.core.request import Request, SamplingParams
from kvstack.kv.segments import (
    LOADING,
    SegmentCache,
    SegmentEntry,
    segment_key,
    segment_namespace,
)
from kvstack.sched.output import (
    RecomputeSpan,
    ScheduledRequest,
    SchedulerOutput,
    SegmentImport,
    recompute_rows,
)

if TYPE_CHECKING:
    from kvstack.kv.tiers.segments import SegmentTiers

FILL_PREFIX = "kvstack-segment-fill:"


def _lead_id(lead: tuple[int, ...]) -> str:
    """The fill request id of a shared lead."""
    return FILL_PREFIX + "lead-" + segment_key(b"lead", lead).hex()


@dataclass
class Placement:
    """What the scheduler does at a request's chunk start: copies, repair, the chunk's
    first position (past the copies) and the position the chunk must stop at."""

    imports: list[SegmentImport] = field(default_factory=list)
    recompute: list[RecomputeSpan] = field(default_factory=list)
    used: list[int] = field(default_factory=list)  # span indices copied
    start: int = 0
    limit: int = 0
    gap_tokens: int = 0  # of the rows: tokens between two copied segments
    skipped: bool = False  # a segment without a usable entry lies before ``start``

    @property
    def rows(self) -> int:
        return recompute_rows(self.recompute)


class SegmentPlanner:
    def __init__(self, cache: SegmentCache, model_id: str = "") -> None:
        self.cache = cache
        self.model_id = model_id
        self.held: dict[str, list[SegmentEntry | None]] = {}  # request id -> per span
        # Per request whose queries were counted: the spans cached on its arrival.
        self._arrival_hits: dict[str, set[int]] = {}
        self.reserver: str | None = None  # the one request holding an incomplete set
        self.tiers: SegmentTiers | None = None  # entries in the offload tiers
        # The most repair rows one step may carry (the engine: --max-num-batched-tokens
        # - 1, so the chunk after them always has a token).
        self.max_rows = sys.maxsize

    def _lead(self, req: Request, i: int) -> tuple[int, ...]:
        """What segment ``i``'s entry is computed after: the sink and its primer."""
        assert req.segments is not None
        return (*self.cache.sink, *req.segments.primer(i))

    def _key(self, req: Request, i: int) -> bytes:
        assert req.segments is not None
        a, b = req.segments.spans[i]
        ns = segment_namespace(self.model_id, req.cache_salt, self._lead(req, i))
        return segment_key(ns, req.prompt_token_ids[a:b])

    # ------------------------------------------------------------------ admission
    def prepare(self, req: Request, out: SchedulerOutput, budget: int) -> tuple[bool, int]:
        """Admission gate: ``(ready, tokens)`` — whether every segment has a ready entry,
        and how many tokens of ``budget`` the fills scheduled into ``out`` take.

        A request holds (``users``) the entries it looked at until it copies them. Only
        one waiting request at a time (``reserver``) may hold an incomplete set, while
        its missing entries are reserved and computed as budget and room allow: two
        requests each holding part of what the other needs would wait forever.
        """
        assert req.segments is not None
        rid = req.request_id
        spans = req.segments.spans
        if rid not in self._arrival_hits:  # queries and hits counted once per request
            hits = self._arrival_hits[rid] = set()
            for i, span in enumerate(spans):
                n = span[1] - span[0]
                self.cache.counters.query_tokens += n
                if self.cache.entries.get(self._key(req, i)) is not None:
                    self.cache.counters.hit_tokens += n
                    hits.add(i)
        held = self.held.get(rid)
        if held is None:
            if self.reserver is not None and self.reserver != rid:
                ready = [self.cache.entries.get(self._key(req, i)) for i in range(len(spans))]
                if not all(e is not None and e.ready for e in ready):
                    return False, 0  # another request is completing its set first
            held = self.held[rid] = [None] * len(spans)
        used = 0
        for i in range(len(spans)):
            if self._alive(held[i]):
                continue
            key = self._key(req, i)
            entry = self.cache.get(key)
            if entry is None:
                entry, tokens = self._obtain(req, i, key, out, budget - used)
                used += tokens
            if entry is not None:
                self.cache.hold(entry)
            held[i] = entry
        complete = all(e is not None for e in held)
        if not complete:
            self.reserver = rid
        elif self.reserver == rid:
            self.reserver = None
        return complete and all(e is not None and e.ready for e in held), used

    def _obtain(
        self,
        req: Request,
        i: int,
        key: bytes,
        out: SchedulerOutput,
        budget: int,
    ) -> tuple[SegmentEntry | None, int]:
        """A missing entry: loaded when the offload tiers hold all of it, else reserved
        and computed standalone (a fill); ``(entry, fill tokens)``, ``(None, 0)`` while a
        tier lookup runs or without room or budget now. A tier holds an entry's own
        blocks (its lead past the shared lead's whole blocks: ``lead % block_size``)."""
        assert req.segments is not None
        span = req.segments.spans[i]
        n, lead = span[1] - span[0], self._lead(req, i)
        rest = self.cache.split_lead(lead)[1]
        staged: Any = None  # a complete StagedLoad from the tiers
        if self.tiers is not None:
            staged = self.tiers.lookup(key, self.cache.blocks_for(n, len(rest)))
            if staged == LOADING:
                return None, 0
        if staged is None:
            shared = self.cache.shared_lead(lead)
            if shared is None or not shared.ready:  # computed first (or no room now)
                return None, self._fill_lead(lead, shared, out, budget)
            if budget < len(rest) + n:
                return None, 0
        tokens = req.prompt_token_ids[span[0] : span[1]]
        entry = self.cache.reserve(key, n, tokens, lead, loaded=staged is not None)
        if entry is None:
            return None, 0
        if staged is not None:
            assert self.tiers is not None
            self.tiers.write(entry, staged)
            self.cache.set_ready(entry)
            self.cache.counters.loaded_tokens += n
            return entry, 0
        return entry, self._fill(req, i, entry, out)

    def on_step_done(self) -> None:
        """The step ran: its fills are ready, and go to the offload tiers (write-through)."""
        done = self.cache.mark_ready()
        if self.tiers is not None and done:
            self.tiers.store(done)

    def _alive(self, entry: SegmentEntry | None) -> bool:
        """The entry is still the cache's (a reset drops every entry)."""
        return entry is not None and self.cache.entries.get(entry.key) is entry

    def _fill(self, req: Request, i: int, entry: SegmentEntry, out: SchedulerOutput) -> int:
        """Schedule the standalone prefill of a reserved entry (after its shared lead's
        blocks, computed before); returns the tokens it computes."""
        assert req.segments is not None
        a, b = req.segments.spans[i]
        tokens = [*self._lead(req, i), *req.prompt_token_ids[a:b]]
        done = len(entry.shared)
        table = [x.block_id for x in self.cache.leads[entry.shared].blocks] if done else []
        table += [x.block_id for x in entry.blocks]
        # One extra token so the chunk never completes the sequence: nothing is sampled.
        fill = Request(FILL_PREFIX + entry.key.hex(), [*tokens, tokens[-1]], SamplingParams())
        out.scheduled.append(ScheduledRequest(fill, done, len(tokens) - done, table))
        self.cache.counters.computed_tokens += len(tokens) - done
        return len(tokens) - done

    def _fill_lead(
        self, lead: tuple[int, ...], shared: Any, out: SchedulerOutput, budget: int
    ) -> int:
        """Compute a new shared lead's blocks this step (once: a pending one is being
        computed); returns the tokens it computes."""
        if shared is None or shared.pending:
            return 0
        tokens = list(self.cache.split_lead(lead)[0])
        if budget < len(tokens):
            return 0
        shared.pending = True
        fill = Request(_lead_id(lead), [*tokens, tokens[-1]], SamplingParams())
        table = [x.block_id for x in shared.blocks]
        out.scheduled.append(ScheduledRequest(fill, 0, len(tokens), table))
        self.cache.counters.computed_tokens += len(tokens)
        return len(tokens)

    def forget(self, req: Request, finished: bool) -> None:
        """A preempted or finished request lets go of the entries it had not copied."""
        if finished:
            self._arrival_hits.pop(req.request_id, None)
        if self.reserver == req.request_id:
            self.reserver = None
        for entry in self.held.pop(req.request_id, ()):
            if entry is not None:
                self.cache.unhold(entry)

    # ------------------------------------------------------------------ placement
    def _usable(self, rid: str, i: int) -> SegmentEntry | None:
        held = self.held.get(rid)
        entry = held[i] if held is not None else None
        return entry if entry is not None and self._alive(entry) and entry.ready else None

    def place(self, req: Request, c: int) -> Placement | None:
        """Copies and repair at chunk start ``c`` (None: no segment left to copy). Pure:
        nothing changes until ``commit``."""
        marks = req.segments
        if marks is None or req.request_id not in self.held or c >= marks.spans[-1][1]:
            return None
        plan = Placement(start=c, limit=req.num_tokens)
        for i, (a, b) in enumerate(marks.spans):
            if b <= plan.start:
                continue
            entry = self._usable(req.request_id, i)
            if entry is None:
                plan.skipped = True
                continue  # computed in place
            if a > plan.start and (not plan.imports or plan.skipped):
                plan.limit = a
                break
            gap, at = max(0, a - plan.start), max(a, plan.start)
            # EPIC's first tokens not yet computed (a prefix hit or a chunk may have
            # computed the segment's first ones in place, exactly), and the ratio of
            # the rest: the same rows whichever way the segment's start was reached.
            first = min(max(0, marks.recompute_tokens - (at - a)), b - at)
            count = math.ceil(marks.recompute_ratio * (b - at - first) - 1e-9)
            if plan.imports and plan.rows + gap + first + count > self.max_rows:
                # One step's rows stay within its token budget (a chunk of >= 1 token
                # after them): the separators, or this segment's first token, are
                # computed in place as the chunk, and the copies go on next step.
                plan.limit = a if gap else a + 1
                break
            if gap:  # the tokens between two copies: rows of this forward
                plan.recompute.append(RecomputeSpan(plan.start, a, gap, 0))
                plan.gap_tokens += gap
                plan.start = a
            blocks = tuple(x.block_id for x in entry.blocks)
            src = entry.lead + plan.start - a
            imp = SegmentImport(blocks, src, plan.start, b - plan.start, entry.shift)
            plan.imports.append(imp)
            plan.recompute.append(RecomputeSpan(plan.start, b, first, count))
            plan.used.append(i)
            plan.start = b
        if not plan.imports and plan.limit == req.num_tokens:
            return None
        return plan

    def commit(self, req: Request, plan: Placement) -> None:
        """The scheduled step copies ``plan``: release those entries, stop prefix-cache
        registration at the first copy, count the tokens (the request's
        ``num_segment_tokens``: tokens copied from entries that were cached on arrival)."""
        held = self.held.get(req.request_id)
        for i in plan.used:
            assert held is not None
            entry = held[i]
            if entry is not None:
                self.cache.unhold(entry)
                held[i] = None
        if plan.imports:
            first = plan.imports[0].dst_start
            cap = req.cacheable_tokens
            req.cacheable_tokens = first if cap is None else min(cap, first)
        counters = self.cache.counters
        counters.placed_tokens += sum(x.length for x in plan.imports)
        if req.num_preemptions == 0:  # the usage a client sees: first admission only
            # Tokens copied from entries cached on arrival. Copies start past the prefix
            # hit and never overlap: cached + segment tokens never exceed the prompt.
            hits = self._arrival_hits.get(req.request_id, set())
            req.num_segment_tokens += sum(
                imp.length for i, imp in zip(plan.used, plan.imports, strict=True) if i in hits
            )
        counters.recomputed_tokens += plan.rows - plan.gap_tokens

    def check_integrity(self, live: set[str]) -> None:
        """Only live requests hold entries; each held entry counts it among its users."""
        assert set(self.held) <= live, "a finished request still holds segment entries"
        assert self.reserver is None or self.reserver in self.held, "reserver holds nothing"
        users: dict[int, int] = {}
        for entries in self.held.values():
            for e in entries:
                if e is not None and self.cache.entries.get(e.key) is e:
                    users[id(e)] = users.get(id(e), 0) + 1
        for e in self.cache.entries.values():
            assert e.users == users.get(id(e), 0), f"segment entry with {e.users} users"
