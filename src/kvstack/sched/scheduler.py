"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

Follows vLLM v1's unified scheduler: there are no prefill and decode phases, only
requests whose ``num_computed_tokens`` lags ``num_tokens``. Each step:

1. Running requests, oldest first, get the tokens they still lack (1 for a decoding
   request, a chunk of the prompt for a long prefill), capped by the step's token
   budget (``max_num_batched_tokens``). When the pool has no block for one of them, the
   *newest* running request is preempted (FCFS priority): its blocks are freed, its
   ``num_computed_tokens`` reset to 0, and it goes back to the front of the waiting
   queue; later it recomputes prompt + generated tokens and continues where it left
   off (vLLM's "recompute" preemption).
2. If nobody was preempted, waiting requests are admitted in arrival order while the
   budget, ``max_num_seqs`` and free blocks allow. An admitted request first adopts
   the longest cached prefix of its tokens (prefix reuse, ``kv/manager.py``), then
   computes the rest; a remainder longer than the budget is admitted with a chunk
   (chunked prefill) and continues next step. A preempted request re-admitted later
   finds its own earlier blocks in the cache unless they were evicted meanwhile.
   With offload tiers the prefix is extended by blocks loaded from host, disk
   or Redis; a request whose tier lookup is still in flight is skipped (it keeps its
   place in the queue) so the lookup never stalls the batch.

Requests that could never run (longer than the context or the whole pool) are refused
by ``add_request`` so they cannot block the queue.

Speculative decoding (``spec/``): a decoding request with a proposal gets its draft as
extra rows (``ScheduledRequest.draft_token_ids``), cut to the step's budget and the
request's room, and only if the pool has the slots without preempting anyone. After
verification ``update_from_output`` appends the kept tokens one at a time under the
stop rules and rolls the rest back::

    before:   computed t0 .. t(N-2) | scheduled t(N-1) d1 d2 d3   (N tokens, 3 drafts)
    verified: d1 d2 kept, d3 rejected; c = the token row 2 sampled instead
    after:    tokens t0 .. t(N-1) d1 d2 c (N + 3); num_computed_tokens = N + 2 (c's KV
              is computed next step, in d3's stale slot); blocks past the last token's
              slot are freed (``KVManager.rollback_slots``); no unverified token was hashed
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import Request, RequestStatus
from kvstack.sched.output import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from kvstack.kv.base import KVManager
    from kvstack.kv.press.coordinator import PressCoordinator
    from kvstack.kv.tiers.connector import TierConnector
    from kvstack.sched.config import SchedulerConfig
    from kvstack.sched.segments import Placement, SegmentPlanner


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVManager,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions_total = 0
        self.num_prefill_tokens_computed = 0  # prompt positions run through the model
        self.last_num_scheduled_tokens = 0  # of the last schedule() (vllm:iteration_tokens)
        # Tiers (``kv/tiers/connector.py``): loads prefixes from offload tiers, set by the engine.
        self.connector: TierConnector | None = None
        # Presses (``kv/press/coordinator.py``): press points cap chunks; set by the engine.
        self.press: PressCoordinator | None = None
        # Segment reuse (``sched/segments.py``): set by the engine.
        self.segments: SegmentPlanner | None = None
        self.max_num_running = 0  # peak concurrency seen

    # ------------------------------------------------------------------ admission
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``InvalidRequestError`` if such a request could never be served."""
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens but the model's context length "
                f"(max_model_len) is {self.max_model_len}; at least one token must be generated",
                param="prompt",
            )
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}",  # no sum: it may pass 4,300 digits
                param="max_tokens",
            )
        if not self.kv.can_ever_fit(total):
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens needs "
                f"{self.kv.num_blocks_for(total)} {self.kv.block_unit} but the cache has only "
                f"{self.kv.num_blocks} (block size {self.kv.block_size}); "
                "raise --kv-cache-memory/--num-blocks or lower max_tokens",
                param="max_tokens",
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_request_ids:
            self._admit_waiting(out, budget)
        for s in out.scheduled:
            req = s.request
            p, c = req.num_prompt_tokens, s.num_computed_tokens
            self.num_prefill_tokens_computed += min(c + s.num_new_tokens, p) - min(c, p)
            self.num_prefill_tokens_computed += s.num_recompute_rows
            req.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids)
        self.max_num_running = max(self.max_num_running, len(self.running))
        self.last_num_scheduled_tokens = out.total_num_scheduled_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Step 1: running requests, oldest first, preempting the newest for blocks.
        Returns the token budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            plan = self._place(req, req.num_computed_tokens)
            skip = 0 if plan is None else plan.start - req.num_computed_tokens  # copied
            limit = req.num_tokens if plan is None else plan.limit
            rows = 0 if plan is None else plan.rows  # segment repair rows
            num_new = min(limit - req.num_computed_tokens - skip, budget - rows)
            if self.press is not None:  # a chunk stops at the press point
                num_new = self.press.max_new_tokens(req, req.num_computed_tokens, num_new)
            if num_new <= 0 and rows:  # no budget left for the repair rows this step
                i += 1
                continue
            assert num_new > 0, f"running request {req.request_id} has nothing to compute"
            draft = self._draft(req, num_new, budget)
            block_ids = self.kv.allocate_slots(req, skip + num_new + len(draft))
            if block_ids is None and draft:  # speculation never preempts anyone
                draft = []
                block_ids = self.kv.allocate_slots(req, skip + num_new)
            while block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is req:
                    break
                block_ids = self.kv.allocate_slots(req, skip + num_new)
            if block_ids is None:
                break
            num_new += len(draft)
            out.scheduled.append(self._scheduled(req, plan, num_new, block_ids, draft))
            budget -= num_new + rows
            i += 1
        return budget

    def _place(self, req: Request, c: int) -> Placement | None:
        """Segment copies and repair at chunk start ``c``, or None."""
        if self.segments is None or req.segments is None:
            return None
        return self.segments.place(req, c)

    def _scheduled(
        self,
        req: Request,
        plan: Placement | None,
        num_new: int,
        block_ids: list[int],
        draft: list[int] | None = None,
    ) -> ScheduledRequest:
        """The step's entry for ``req``; a segment plan moves it past the copies."""
        groups = self.kv.group_block_ids(req.request_id)
        if plan is None:
            return ScheduledRequest(
                req, req.num_computed_tokens, num_new, block_ids, draft or [],
                group_block_ids=groups,
            )  # fmt: skip
        assert self.segments is not None
        self.segments.commit(req, plan)
        req.num_computed_tokens = plan.start
        return ScheduledRequest(
            req, plan.start, num_new, block_ids, draft or [], plan.imports, plan.recompute,
            group_block_ids=groups,
        )  # fmt: skip

    def _draft(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The draft rows a decoding request gets: its proposal (used once), cut so that
        the rows fit the budget and the kept run (drafts + bonus) fits max_tokens and the
        context."""
        draft, req.spec_token_ids = req.spec_token_ids, []
        if not draft or num_new != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return []
        room = min(
            budget - 1,
            req.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        return draft[: max(0, room)]

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Step 2: admit waiting requests in arrival order while budget, seats and blocks
        allow; each adopts its cached prefix and tier blocks first."""
        skipped: list[Request] = []  # waiting on an offload-tier lookup
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self.connector is not None and self.connector.is_loading(req):
                skipped.append(self.waiting.popleft())
                continue
            if self.segments is not None and req.segments is not None:
                ready, used = self.segments.prepare(req, out, budget)
                budget -= used  # standalone segment prefills (fills) run this step
                if not ready:  # its segments are computed this step: admit it next
                    skipped.append(self.waiting.popleft())
                    continue
            # Prefix reuse: adopt the longest cached prefix; compute only the rest.
            computed = self.kv.get_computed_blocks(req)
            num_ext = offered = 0  # blocks after the hit the offload tiers supply
            if self.connector is not None:
                matched = self.connector.match_external(req, computed, budget, bool(self.running))
                if matched is None:
                    break  # no room to load yet; running requests will free some
                num_ext = offered = matched
            if self.press is not None:  # never reuse past the press point
                cap = self.press.max_cached_blocks(req, len(computed) + num_ext, self.kv.block_size)
                computed = computed[:cap]
                num_ext = max(0, min(num_ext, cap - len(computed)))
            num_hit = len(computed) + num_ext
            num_cached = num_hit * self.kv.block_size
            plan = self._place(req, num_cached)
            start = num_cached if plan is None else plan.start  # past segment copies
            rows = 0 if plan is None else plan.rows
            num_new = (req.num_tokens if plan is None else plan.limit) - start
            if num_new + rows > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget - rows)
            if self.press is not None:  # the press runs once its point is computed
                num_new = self.press.max_new_tokens(req, num_cached, num_new)
            if num_new <= 0:
                break
            block_ids = self.kv.allocate_slots(req, start - num_cached + num_new, computed, num_ext)
            if block_ids is None:
                break
            if self.connector is not None and offered:  # (num_ext may be 0 after the cap)
                self.connector.write_external(req, len(computed), num_hit)
            self.waiting.popleft()
            self._start(req, num_cached, num_hit)
            out.scheduled.append(self._scheduled(req, plan, num_new, block_ids))
            budget -= num_new + rows
        self.waiting.extendleft(reversed(skipped))

    def _start(self, req: Request, num_cached: int, num_hit: int) -> None:
        """An admitted request: past its ``num_cached`` hit tokens, running."""
        req.num_computed_tokens = num_cached
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_cached
            if self.connector is not None:
                req.cached_tokens_by_tier = self.connector.cached_tokens_by_tier(req, num_hit)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def requeue(self, req: Request) -> None:
        """Preempt a running request (recompute later): its step read KV that a failed
        request of the same step wrote (``step_isolation.py``)."""
        self.running.remove(req)
        self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        if self.segments is not None:
            self.segments.forget(req, finished=False)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        if self.press is not None:
            self.press.on_request_preempted(req)
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ results
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, int],
        accepted: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Append each sampled token, apply token-level stop rules, free finished requests.

        ``accepted`` (speculative decoding): per verified request, the draft tokens kept
        before its ``sampled`` token. The run is appended token by token and cut at the
        first stop (EOS, stop token, max_tokens, context), exactly where one-token steps
        would have stopped; a request that goes on is rolled back past the rejected rows.
        Returns the requests that received a token (finished ones included).
        """
        changed: list[Request] = []
        if self.segments is not None:  # this step computed the segments it reserved
            self.segments.on_step_done()
        for s in out.scheduled:
            req = s.request
            rid = req.request_id
            if req.is_finished() or rid not in sampled:
                continue
            run = [*accepted.get(rid, ()), sampled[rid]] if accepted else [sampled[rid]]
            changed.append(req)
            for token in run:
                req.output_token_ids.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    self.finish_request(rid, status)
                    break
            if s.draft_token_ids and not req.is_finished():
                req.num_computed_tokens = req.num_tokens - 1  # the kept run's KV, not its last
                self.kv.rollback_slots(req)
        return changed

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, abort, error) a request wherever it is; frees its blocks. Idempotent."""
        assert status.finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        if self.segments is not None:
            self.segments.forget(req, finished=True)
        if self.connector is not None:
            self.connector.on_request_finished(request_id)
        if self.press is not None:
            self.press.on_request_finished(request_id)
        req.status = status
        req.finished_time = time.monotonic()
        self._finished_ids.append(request_id)
        return req

    # ------------------------------------------------------------------ introspection
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_deferred(self) -> int:
        """Waiting requests skipped for a transient reason: an offload-tier lookup still
        in flight (vLLM's ``deferred`` reason: KV transfer); the rest wait for capacity."""
        if self.connector is None:
            return 0
        return sum(1 for r in self.waiting if self.connector.is_loading(r))

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert not running_ids & waiting_ids, "request both running and waiting"
        assert running_ids | waiting_ids == set(self.requests), "request table out of sync"
        assert len(self.running) <= self.config.max_num_seqs
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert 0 < r.num_computed_tokens <= r.num_tokens
            held = len(self.kv.get_block_ids(r.request_id)) * self.kv.block_size
            assert held >= r.num_kv_tokens, f"{r.request_id} lacks KV slots"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
            assert not self.kv.get_block_ids(r.request_id), f"waiting {r.request_id} holds blocks"
        for rid in self.kv.held_request_ids():
            assert rid in running_ids, f"blocks held by non-running request {rid}"
        if self.segments is not None:
            self.segments.check_integrity(running_ids | waiting_ids)
