"""Run the profile workload on a real engine: prefill ``batch`` prompts of ``context``
tokens, then decode ``steps`` steps of the ``batch`` requests, operators timed.

Phases are measured apart, so no step mixes them:

* **prefill**: ``batch`` requests of ``context`` random tokens with ``max_tokens=1`` (they
  finish when their prompt is done, so no decode row ever joins); every step is measured.
* **decode**: the same prompts again (prefix-cache hits: only the last block is
  recomputed), ``warmup`` steps after the last prompt finished, then ``steps`` steps in
  which every scheduled row is a decode.

Prompts are random token ids (seeded); EOS is ignored, so every request runs to its
length. A request needs ``context + warmup + steps + 2`` tokens of KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.core.errors import ConfigError
from kvstack.core.request import SamplingParams
from kvstack.tools.profile.instrument import OpStat, Recorder, instrument


@dataclass
class PhaseResult:
    """One phase: per-operator totals, step walls, tokens processed."""

    name: str
    steps: int = 0
    tokens: int = 0  # rows computed (prompt tokens or decoded tokens)
    wall_s: float = 0.0
    step_walls: list[float] = field(default_factory=list)
    ops: dict[str, OpStat] = field(default_factory=dict)
    context_lens: list[int] = field(default_factory=list)  # decode: of the last step


@dataclass(frozen=True)
class Workload:
    batch: int
    context: int
    steps: int = 8
    warmup: int = 2
    seed: int = 0

    @property
    def new_tokens(self) -> int:
        """Tokens each decode request generates: the first (its prefill), the warm-up and
        measured steps, and one more so no request finishes inside the measured steps."""
        return self.warmup + self.steps + 2

    @property
    def tokens_per_request(self) -> int:
        return self.context + self.new_tokens


def check_context(w: Workload, limit: int) -> None:
    """``ConfigError`` (one line) if a request of ``w`` is longer than ``limit`` tokens."""
    if w.tokens_per_request > limit:
        raise ConfigError(
            f"context {w.context} + {w.new_tokens} decode tokens exceeds the "
            f"model's context {limit}"
        )


def check_fits(engine: Any, w: Workload) -> None:
    """``ConfigError`` (one line) if the workload cannot run on this engine."""
    check_context(w, engine.max_model_len)
    bs = engine.config.cache.block_size
    need = w.batch * -(-w.tokens_per_request // bs)
    have = engine.kv_manager.num_blocks
    if need > have:
        raise ConfigError(
            f"batch {w.batch} x {w.tokens_per_request} tokens needs {need} KV blocks, the KV "
            f"budget holds {have} (raise --kv-cache-memory or lower --batch/--context)"
        )
    if w.batch > engine.config.scheduler.max_num_seqs:
        raise ConfigError(f"batch {w.batch} exceeds max_num_seqs")


def _prompts(w: Workload, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(w.seed)
    ids = torch.randint(0, vocab, (w.batch, w.context), generator=g)
    return [row.tolist() for row in ids]


def _prompt_left(engine: Any) -> int:
    sched = engine.scheduler
    left = sum(r.num_prompt_tokens for r in sched.waiting)
    return left + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.running)


def _step(engine: Any, rec: Recorder, phase: PhaseResult | None) -> None:
    rec.phase = phase.name if phase is not None else None
    t0 = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t0
    rec.phase = None
    if phase is not None:
        phase.steps += 1
        phase.wall_s += dt
        phase.step_walls.append(dt)


def run_workload(
    engine: Any, w: Workload, tick: Callable[[str, int], None] = lambda phase, n: None
) -> tuple[PhaseResult, PhaseResult]:
    """Prefill, then decode, on ``engine``; ``tick(phase, tokens)`` after each step."""
    check_fits(engine, w)
    prompts = _prompts(w, engine.model.config.vocab_size)
    rec = Recorder()
    prefill, decode = PhaseResult("prefill"), PhaseResult("decode")
    with instrument(engine, rec):
        warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        engine.add_request("warm", None, warm, prompt_token_ids=prompts[0][: min(64, w.context)])
        while engine.has_unfinished_requests():  # first-step allocations, not measured
            _step(engine, rec, None)
        engine.reset_prefix_cache()
        once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"prefill-{i}", None, once, prompt_token_ids=p)
        while engine.has_unfinished_requests():
            before = _prompt_left(engine)
            _step(engine, rec, prefill)
            tick("prefill", before - _prompt_left(engine))
        prefill.tokens = w.batch * w.context
        sp = SamplingParams(temperature=0, max_tokens=w.new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"decode-{i}", None, sp, prompt_token_ids=p)
        sched = engine.scheduler
        while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
            _step(engine, rec, None)  # the re-prefill of the uncached tail
        for _ in range(w.warmup):
            _step(engine, rec, None)
        for _ in range(w.steps):
            n = len(sched.running)
            decode.context_lens = [r.num_computed_tokens + 1 for r in sched.running]
            _step(engine, rec, decode)
            decode.tokens += n
            tick("decode", n)
        engine.abort_request([f"decode-{i}" for i in range(w.batch)])
    for (phase, name), st in rec.stats.items():
        (prefill if phase == "prefill" else decode).ops[name] = st
    return prefill, decode
