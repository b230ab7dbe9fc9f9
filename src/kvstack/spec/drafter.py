"""Drafter: a draft model's guesses, computed in the step that verifies them.

``spec/draft_model.py`` asks for ``k`` draft rows per request holding placeholders; at
the start of the step (slots allocated, rows cut to the budget) the drafter replaces
them, in place, with the draft model's greedy tokens: draft forward ``j`` runs one row
per request whose draft is longer than ``j`` — its last real token at ``j = 0``, else
its guess ``d_j`` — at position ``n + j``, writing that row's KV into the request's own
slot ``n + j``::

    positions:   0 .. n-1        n      n+1    n+2    n+3       (k = 3)
    KV before:   target's        -      -      -      -
    draft j=0:   reads 0..n-1    x->d1  (writes slot n)
    draft j=1:   reads 0..n      d1->d2 (writes slot n+1)
    draft j=2:   reads 0..n+1    d2->d3 (writes slot n+2)
    verify:      target forward of [x d1 d2 d3] at n..n+3 writes all four slots first

So the draft **shares the target's KV cache**: it reads the target's KV of everything
verified (better than its own would be) and needs no KV of its own and no prefill; its
rows' KV is overwritten by the verify forward before anything reads it. The price: the
draft must have the target's KV shape (layers, KV heads, head_dim, windows) and
vocabulary — the same model with other weights or quantization (``check_compatible``),
e.g. a bf16 target drafted by its own GGUF weights kept quantized. Presses, codecs and
sliding windows need nothing extra: a draft row's attention metadata is built exactly
as a decode row's (``ModelRunner.decode_rows``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvstack.core.errors import ConfigError
from kvstack.sched.output import ScheduledRequest
from kvstack.spec.config import DRAFT_MODEL, SpeculativeConfig
from kvstack.spec.stats import SpecDecodeStats

if TYPE_CHECKING:
    from kvstack.model.arch.decoder import LlamaModel
    from kvstack.model.runner import ModelRunner

logger = logging.getLogger("kvstack.model")


def build_drafter(
    target: LlamaModel,
    spec: SpeculativeConfig | None,
    dtype: str,
    seed: int,
    stats: SpecDecodeStats | None = None,
) -> Drafter | None:
    """The ``Drafter`` of a ``draft_model`` config (None for other methods): the draft
    loaded with its ``quantization`` in the target's ``dtype``, checked compatible; its
    forwards' time is counted in ``stats.propose_seconds`` (a proposal's cost)."""
    if spec is None or spec.method != DRAFT_MODEL:
        return None
    from kvstack.model.loader.registry import build_model

    assert spec.model is not None  # SpeculativeConfig's invariant
    draft = build_model(spec.model, dtype, seed, spec.quantization or "none")
    check_compatible(target, draft)
    logger.info(
        "speculative decoding: draft model %s (--quantization %s), up to %d guesses a step, "
        "written into the target's KV cache", spec.model, spec.quantization or "none",
        spec.num_speculative_tokens,
    )  # fmt: skip
    return Drafter(draft, stats)


def check_compatible(target: LlamaModel, draft: LlamaModel) -> None:
    """``ConfigError`` unless ``draft`` can write rows into ``target``'s KV cache."""
    t, d = target.config, draft.config
    fields = ("num_layers", "num_kv_heads", "head_dim", "vocab_size")
    diff = [f"{f} {getattr(d, f)} vs {getattr(t, f)}" for f in fields
            if getattr(t, f) != getattr(d, f)]  # fmt: skip
    if [t.layer_window(i) for i in range(t.num_layers)] != [
        d.layer_window(i) for i in range(d.num_layers)
    ]:
        diff.append("sliding windows")
    if diff:
        raise ConfigError(
            "speculative_config: the draft model writes its rows into the target's KV "
            f"cache, so it needs the target's KV shape and vocabulary ({'; '.join(diff)})"
        )


class Drafter:
    def __init__(self, model: LlamaModel, stats: SpecDecodeStats | None = None) -> None:
        self.model = model
        self.stats = stats
        self.forwards = 0  # draft forwards run (each one row per drafting request)

    def fill(self, runner: ModelRunner, scheduled: Sequence[ScheduledRequest]) -> None:
        """Replace the placeholder drafts of ``scheduled`` with the draft's guesses."""
        todo = [s for s in scheduled if s.draft_token_ids]
        if not todo:
            return
        t0 = time.perf_counter()
        cur = [s.request.tokens(s.num_computed_tokens, 1)[0] for s in todo]
        for j in range(max(len(s.draft_token_ids) for s in todo)):
            live = [i for i, s in enumerate(todo) if len(s.draft_token_ids) > j]
            rows = [
                replace(todo[i], num_computed_tokens=todo[i].num_computed_tokens + j,
                        num_new_tokens=1, draft_token_ids=[], segment_imports=[], recompute=[])
                for i in live
            ]  # fmt: skip
            guesses = self._step(runner, rows, [cur[i] for i in live])
            for i, tok in zip(live, guesses, strict=True):
                todo[i].draft_token_ids[j] = cur[i] = tok
        if self.stats is not None:
            self.stats.propose_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def _step(self, runner: ModelRunner, rows: list[ScheduledRequest], ids: list[int]) -> list[int]:
        """One draft forward of one row per request: its greedy next tokens."""
        positions, meta = runner.decode_rows(rows)
        logits = self.model.forward(
            torch.tensor(ids), positions, meta, runner.kv, None,
            float_logits=False,
        )  # fmt: skip
        self.forwards += 1
        return logits.argmax(-1).tolist()
