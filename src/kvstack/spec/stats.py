"""``SpecDecodeStats``: vLLM's speculative-decoding counters (``v1/spec_decode/metrics.py``).

One *draft* is one request's proposal verified in one step. vLLM's families, all
counters (``_total`` in the exposition), labels ``model_name`` and ``engine`` plus
``position`` for the per-position one (every position ``0 .. k - 1`` exported, also
at zero)::

    vllm:spec_decode_num_drafts                  drafts verified
    vllm:spec_decode_num_draft_tokens            draft tokens verified
    vllm:spec_decode_num_accepted_tokens         draft tokens accepted (no bonus token)
    vllm:spec_decode_num_accepted_tokens_per_pos{position}

Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted /
drafts (vLLM's convention: with the bonus token). Counted as vLLM counts: the
sampler's verdict, before stop rules cut the accepted run. Invariants: accepted <=
draft tokens; ``accepted_per_pos`` is non-increasing and its sum is ``accepted``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_per_pos: list[int] = field(default_factory=list)
    propose_seconds: float = 0.0  # wall time spent proposing (a draft model's forwards too)
    num_proposals: int = 0  # proposer calls (empty proposals included)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_per_pos = self.accepted_per_pos or [0] * k
        self.draft_per_pos = self.draft_per_pos or [0] * k

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """vLLM's ``SpecDecodingStats.observe_draft``."""
        assert 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_speculative_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.accepted_per_pos[i] += 1
        for i in range(num_draft_tokens):
            self.draft_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "propose_us_mean": 1e6 * self.propose_seconds / self.num_proposals
            if self.num_proposals
            else 0.0,
        }

    def check_integrity(self) -> None:
        assert self.num_accepted_tokens <= self.num_draft_tokens
        assert sum(self.accepted_per_pos) == self.num_accepted_tokens
        assert sum(self.draft_per_pos) == self.num_draft_tokens
        pos = self.accepted_per_pos
        assert all(a >= b for a, b in itertools.pairwise(pos)), "per-position rises"
