"""The ``draft_model`` proposer: a second model guesses, in the runner (vLLM's method).

vLLM spells it ``{"model": DRAFT, "num_speculative_tokens": k}`` (and ``quantization``
for the draft's weights). A draft model must run a forward per guessed token, which
only the runner can do, and only once the scheduler has given the step's rows their KV
slots. So this proposer guesses nothing itself: it asks for ``k`` rows, holding
placeholders (the last token, repeated), and ``spec/drafter.py`` replaces them with the
draft model's greedy tokens in place, at the start of the step that verifies them::

    after step t    propose  -> [x x x x]             placeholders (k rows asked)
    step t+1        scheduler cuts them to the budget, allocates their slots
                    drafter  -> [d1 d2 d3 d4]         k draft forwards, one row each
                    target   -> verifies [x d1 .. d4] in one forward (rejection sampler)

The guesses are a point mass (greedy), which the rejection sampler's rule assumes, so
sampling stays exact whatever the draft is (deviation from vLLM, which samples the
draft and passes its probabilities).
"""

from __future__ import annotations

from collections.abc import Sequence


class DraftModelProposer:
    """``k`` placeholder rows; ``spec/drafter.py`` fills them (``fills_in_runner``)."""

    fills_in_runner = True

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [token_ids[-1]] * k if token_ids else []
