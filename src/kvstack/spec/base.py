"""The ``Proposer`` protocol: guesses of a request's next tokens, verified by the target.

Speculative decoding (Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling", 2023): a cheap proposer guesses ``k`` tokens, the
target model scores all of them in one forward of ``k + 1`` rows, and rejection
sampling keeps a prefix of the guesses plus one token of its own
(``model/sampling/rejection.py``). A proposal is only a guess: whatever a proposer
returns, the output is the target model's (greedy: token for token; sampling: in
distribution).

A proposer is deterministic (a point mass ``q``), which is what the rejection sampler
assumes. One protocol, one registry (``spec.PROPOSERS``): a draft-model proposer would
be one more entry, returning its own tokens (and would need draft probabilities for the
sampler's general rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Guesses the tokens that follow ``token_ids`` (prompt + output so far)."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most ``k`` draft tokens (an empty list: nothing to guess this step)."""
        ...
