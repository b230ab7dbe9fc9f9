"""Step isolation: a request that makes a model step raise fails alone.

This is kvstack's own design: vLLM v1 has no such bisection (an exception in its
model step fails every request of the step, or the whole engine). When
``ModelRunner.execute`` raises, ``recover_step`` finds the request responsible by
bisection over the step's scheduled requests, fails only that one with its own error
and keeps the others' results::

    step [0 1 2 3 4 5 6 7] raised          (say request 6 is bad)
    run  [0 1 2 3]       ok  -> kept;  suspects [4 5 6 7], unconfirmed
    run  [4 5]           ok  -> kept;  suspects [6 7]
    run  [6]             raised -> suspects [6], confirmed: 6 fails with its error
    run  [7]             the rest (not yet run, not failed): kept

At most ``ceil(log2 n)`` bisection runs, one run to confirm an unconfirmed last
suspect and one run of the rest. A last suspect that runs fine alone means no single
request is responsible: nothing fails if every request then ran in some piece; a rest
run that raises fails its requests together (the step's failure as before).

Invariants:

* **Each run starts from the step's start.** What an attempt advances is put back for
  the members of the next run: the global RNG (unseeded rows) and the sampler's own
  generator; a grammar matcher is rewound to the request's output tokens; the prompt
  logprobs list to its length. Seeded rows draw from a generator made from
  ``(seed, number of output tokens)`` (``model/sampling/metadata.py``), so a re-run
  draws the same noise and a kept request's tokens are those of the full step. The
  scheduler's decisions (block tables, ``num_computed_tokens``) are not re-made: every
  run executes entries of the one ``SchedulerOutput``.
* **KV rows a failed attempt wrote are never published.** They are rewritten by the
  run that keeps the request; the blocks written this step by a request that did not
  end in a kept run lose their prefix-cache entries (``KVManager.forget_blocks``);
  every entry cached before the step, and every pin, stays.
* **Reads within a step.** Blocks are registered in the prefix cache when scheduled
  (``kv/manager.py``), so a request admitted later in the step may read KV another
  request of the step writes. Every run therefore includes the requests its members
  read from (``closure``), and a request that read KV written by a failed request is
  requeued (preempted: it recomputes later) instead of kept.

Steps with segment work (standalone fills, copies, repair rows: ``sched/segments.py``)
are not bisected: they fail whole and reset the device cache, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from kvstack.core.request import Request, RequestOutput, RequestStatus
from kvstack.engine.output_processor import OutputProcessor
from kvstack.kv.base import KVManager, cdiv
from kvstack.kv.tiers.connector import TierConnector
from kvstack.model.runner import ModelRunner, RunnerOutput
from kvstack.model.structured.manager import StructuredOutputManager
from kvstack.sched.output import ScheduledRequest, SchedulerOutput
from kvstack.sched.scheduler import Scheduler

logger = logging.getLogger("kvstack.engine.llm_engine")

STEP_ERROR = "internal error: "  # prefix of a failed step's RequestOutput.error


class StepHost(Protocol):
    """What ``recover_step`` uses of the engine (``LLMEngine`` satisfies it)."""

    @property
    def kv_manager(self) -> KVManager: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def runner(self) -> ModelRunner: ...
    @property
    def structured(self) -> StructuredOutputManager: ...
    @property
    def outputs(self) -> OutputProcessor: ...
    @property
    def connector(self) -> TierConnector | None: ...


# ---------------------------------------------------------------------- blocks
def step_writes(s: ScheduledRequest, block_size: int) -> set[int]:
    """Blocks (pages of every KV group) holding the KV slots the step writes for ``s``."""
    kc = s.num_computed_tokens - s.request.num_dropped
    first, end = kc // block_size, cdiv(kc + s.num_new_tokens, block_size)
    tables = s.group_block_ids or [s.block_ids]
    return {b for t in tables for b in t[first:end]}


def step_reads(s: ScheduledRequest, block_size: int) -> set[int]:
    """Blocks holding KV computed before ``s``'s chunk (all of them are read)."""
    kc = s.num_computed_tokens - s.request.num_dropped
    tables = s.group_block_ids or [s.block_ids]
    return {b for t in tables for b in t[: cdiv(kc, block_size)]}


def closure(members: Iterable[int], deps: Sequence[set[int]]) -> list[int]:
    """``members`` and every entry they read from, transitively; in schedule order."""
    seen = set(members)
    todo = list(seen)
    while todo:
        for j in deps[todo.pop()] - seen:
            seen.add(j)
            todo.append(j)
    return sorted(seen)


def readers(failed: set[int], deps: Sequence[set[int]]) -> set[int]:
    """Entries that read, transitively, KV written by ``failed`` (not ``failed`` itself)."""
    out: set[int] = set()
    grew = True
    while grew:
        grew = False
        for i, d in enumerate(deps):
            if i not in failed and i not in out and d & (failed | out):
                out.add(i)
                grew = True
    return out


# ---------------------------------------------------------------------- state
@dataclass
class StepSnapshot:
    """Per-step state a run advances, taken before the step's first attempt."""

    rng: list[tuple[torch.Generator, torch.Tensor]]
    prompt_lp: dict[str, int]

    @classmethod
    def take(cls, scheduled: Sequence[ScheduledRequest], runner: ModelRunner) -> StepSnapshot:
        gens = [torch.default_generator]
        if runner.sampler.generator is not None:
            gens.append(runner.sampler.generator)
        lps = {
            s.request.request_id: len(s.request.prompt_logprobs)
            for s in scheduled
            if s.request.prompt_logprobs is not None
        }
        return cls([(g, g.get_state()) for g in gens], lps)

    def restore(self, run: Sequence[ScheduledRequest], structured: StructuredOutputManager) -> None:
        """Put back the state of the requests of ``run`` (and the RNGs) before a re-run."""
        for gen, state in self.rng:
            gen.set_state(state)
        for s in run:
            req = s.request
            structured.rewind(req.request_id, len(req.output_token_ids))
            n = self.prompt_lp.get(req.request_id)
            if n is not None and req.prompt_logprobs is not None:
                del req.prompt_logprobs[n:]


def merge(into: RunnerOutput, part: RunnerOutput) -> None:
    """Add a run's per-request results (a later run's replace an earlier one's)."""
    into.sampled.update(part.sampled)
    into.logprobs.update(part.logprobs)
    into.prompt_logprobs.update(part.prompt_logprobs)
    into.press_queries.update(part.press_queries)
    into.grammar_stops.update(part.grammar_stops)
    into.accepted.update(part.accepted)


def keep_only(result: RunnerOutput, ids: set[str]) -> None:
    for d in (result.sampled, result.logprobs, result.prompt_logprobs, result.press_queries,
              result.grammar_stops, result.accepted):  # fmt: skip
        for rid in [r for r in d if r not in ids]:
            del d[rid]


# ---------------------------------------------------------------------- bisection
@dataclass
class Isolation:
    """The outcome of ``isolate``: entries by index into the step's scheduled list."""

    result: RunnerOutput = field(default_factory=RunnerOutput)
    kept: list[int] = field(default_factory=list)  # ran fine: their results are in result
    failed: dict[int, str] = field(default_factory=dict)  # index -> error message
    requeued: list[int] = field(default_factory=list)  # read KV of a failed entry
    forget: set[int] = field(default_factory=set)  # blocks written by failed/requeued
    runs: int = 0


Run = Callable[[list[int]], Exception | None]


def isolate(n: int, error: Exception, attempt: Run, ran: set[int]) -> tuple[int | None, str]:
    """Bisect ``n`` entries whose step raised ``error``; ``attempt(indices)`` runs some
    (adding the ones that ran fine to ``ran``) and returns what it raised, if anything.
    Returns the culprit's index (None: no single one) and its error message."""
    suspects, confirmed, last = list(range(n)), True, error
    while len(suspects) > 1:
        half = len(suspects) // 2
        left, right = suspects[:half], suspects[half:]
        exc = attempt(left)
        if exc is None:
            suspects, confirmed = [i for i in right if i not in ran], False
        else:
            suspects, confirmed, last = left, True, exc
    if not suspects:
        return None, ""
    if not confirmed:
        exc = attempt(suspects)
        if exc is None:
            return None, ""
        last = exc
    return suspects[0], f"{STEP_ERROR}{last}"


def bisect_step(
    scheduled: list[ScheduledRequest],
    error: Exception,
    execute: Callable[[SchedulerOutput], RunnerOutput],
    restore: Callable[[list[ScheduledRequest]], None],
    block_size: int,
) -> Isolation:
    """Run the step's entries in pieces until the failing one is found (module doc)."""
    n = len(scheduled)
    writes = [step_writes(s, block_size) for s in scheduled]
    reads = [step_reads(s, block_size) for s in scheduled]
    deps = [{j for j in range(n) if j != i and writes[j] & reads[i]} for i in range(n)]
    iso, ran = Isolation(), set()

    def attempt(members: list[int]) -> Exception | None:
        run = [scheduled[i] for i in closure(members, deps)]
        restore(run)
        iso.runs += 1
        try:
            part = execute(SchedulerOutput(scheduled=run))
        except Exception as exc:  # what this piece raised: the bisection's signal
            return exc
        merge(iso.result, part)
        ran.update(closure(members, deps))
        return None

    culprit, message = isolate(n, error, attempt, ran)
    if culprit is not None:
        iso.failed[culprit] = message
    rest = [
        i for i in range(n)
        if i not in ran and i not in iso.failed and i not in readers(set(iso.failed), deps)
    ]  # fmt: skip
    if rest and (exc := attempt(rest)) is not None:
        iso.failed.update((i, f"{STEP_ERROR}{exc}") for i in rest)
    failed = set(iso.failed)
    requeued = readers(failed, deps)
    iso.requeued = sorted(requeued)
    iso.kept = [i for i in sorted(ran) if i not in failed and i not in requeued]
    iso.forget = {b for i in failed | requeued for b in writes[i]}
    keep_only(iso.result, {scheduled[i].request.request_id for i in iso.kept})
    return iso


# ---------------------------------------------------------------------- the engine's side
def can_bisect(out: SchedulerOutput, requests: dict[str, Request]) -> bool:
    """Only live requests without segment copies or repair rows (see the module doc)."""
    return all(
        requests.get(s.request.request_id) is s.request and not s.segment_imports
        and not s.recompute
        for s in out.scheduled
    )  # fmt: skip


def fail_requests(host: StepHost, errors: dict[str, str]) -> list[RequestOutput]:
    """Finish requests with ``FINISHED_ERROR`` (blocks freed); their outputs."""
    for rid, message in errors.items():
        req = host.scheduler.requests.get(rid)
        if req is not None:
            req.error = message
        host.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
    ids = set(errors)
    host.structured.release(ids)
    outputs = host.outputs.outputs_for(ids)
    host.outputs.release_finished(ids)
    return outputs


def recover_step(
    host: StepHost, out: SchedulerOutput, error: Exception
) -> tuple[SchedulerOutput, RunnerOutput, list[RequestOutput]]:
    """After ``runner.execute(out)`` raised ``error``: the step's entries that ran fine
    (as a ``SchedulerOutput``), their results, and the failed requests' outputs."""
    kv = host.kv_manager
    if not can_bisect(out, host.scheduler.requests):  # segment work: fail whole
        kv.reset_prefix_cache()
        if host.connector is not None:
            host.connector.discard_step()
        errors = {s.request.request_id: f"{STEP_ERROR}{error}" for s in out.scheduled}
        return replace(out, scheduled=[]), RunnerOutput(), fail_requests(host, errors)
    snap = StepSnapshot.take(out.scheduled, host.runner)
    iso = bisect_step(
        out.scheduled, error, host.runner.execute,
        lambda run: snap.restore(run, host.structured), kv.block_size,
    )  # fmt: skip
    kept_ids = set(iso.kept)  # the others' grammar matchers go back to their outputs
    snap.restore([s for i, s in enumerate(out.scheduled) if i not in kept_ids], host.structured)
    kv.forget_blocks(sorted(iso.forget))
    for i in reversed(iso.requeued):
        host.scheduler.requeue(out.scheduled[i].request)
    if not iso.kept and host.connector is not None:
        host.connector.discard_step()
    errors = {out.scheduled[i].request.request_id: m for i, m in iso.failed.items()}
    logger.warning(
        "failed step isolated in %d runs: %d kept, %d failed (%s), %d requeued",
        iso.runs, len(iso.kept), len(errors), ", ".join(errors) or "none", len(iso.requeued),
    )  # fmt: skip
    kept = [out.scheduled[i] for i in iso.kept]
    return replace(out, scheduled=kept), iso.result, fail_requests(host, errors)
