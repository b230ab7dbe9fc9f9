"""Speculative decoding: proposers, the draft model's forwards, limits, counters.

``PROPOSERS`` is the ``speculative_config`` "method" registry (``core/registry.py``); each
entry builds a ``Proposer`` (``spec/base.py``) from the ``SpeculativeConfig``. Where
each part of speculation lives::

    spec/config.py        SpeculativeConfig (vLLM's --speculative-config JSON)
    spec/ngram.py         prompt lookup: the n-gram proposer (vLLM's "ngram")
    spec/draft_model.py   a draft model's placeholder rows (vLLM's "draft_model")
    spec/drafter.py      the draft model's forwards that fill them, in the runner
    spec/speculator.py    engine hooks: who may speculate, proposals, counters
    spec/stats.py         SpecDecodeStats (vLLM's spec_decode_* counters)
    sched/scheduler.py    draft rows in the step's budget; rollback after verification
    kv/manager.py         rollback_slots: blocks holding only rejected tokens freed
    model/runner.py       the draft rows' inputs and logits
    model/sampling/rejection.py   which drafts are kept (greedy and random rows)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstack.core.registry import Registry
from kvstack.spec.base import Proposer
from kvstack.spec.draft_model import DraftModelProposer
from kvstack.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from kvstack.spec.config import SpeculativeConfig

ProposerFactory = Callable[["SpeculativeConfig"], Proposer]
PROPOSERS: Registry[ProposerFactory] = Registry("speculative method")
PROPOSERS.add(
    "ngram",
    lambda c: NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max),
    "prompt lookup: copy what followed the longest earlier match of the last n tokens",
)
PROPOSERS.add(
    "draft_model",
    lambda c: DraftModelProposer(),
    "a draft model (the target's KV shape) guesses greedily, in the runner",
)


def build_proposer(config: SpeculativeConfig) -> Proposer:
    return PROPOSERS.get(config.method)(config)


__all__ = ["PROPOSERS", "Proposer", "build_proposer"]
