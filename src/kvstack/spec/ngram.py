"""Prompt lookup decoding: the n-gram proposer (vLLM's ``method: "ngram"``).

Prompt lookup decoding (Saxena, 2023; vLLM's ``NgramProposer``) guesses that text
repeats: find the last ``n`` tokens earlier in the request's own prompt + output and
propose what followed them there. vLLM's rule (``v1/spec_decode/ngram_proposer.py``,
``_find_longest_matched_ngram_and_propose_tokens``), followed exactly:

* the match is the *longest* suffix of length ``n`` in ``[min_n, max_n]`` that occurs
  earlier (the suffix itself does not count; occurrences may overlap it);
* among occurrences of that length, the *earliest* in the sequence wins;
* the draft is the up to ``k`` tokens right after it (fewer when the sequence ends
  first); nothing when the sequence is shorter than ``min_n`` or nothing matches::

    tokens:  a b c d x y a b c d z ... a b c d      (suffix "a b c d", n = 4)
             ^^^^^^^ earliest match     ^^^^^^^ suffix
                     ^^^^^^ draft (k = 3): x y a

vLLM finds the match with a KMP scan of the reversed tokens (numba). Here numpy finds
the earlier occurrences of the last token, then extends all of them backwards at once,
one vectorized compare per length up to ``max_n``; the longest (capped at ``max_n``)
wins, the earliest among equals: the same answer (``tests/spec/test_ngram.py`` checks it
against a transcription of vLLM's scan). Cost: one pass over the ``L`` tokens plus
``max_n`` compares of the candidates, ~10-30 us at L = 800 (``propose_us_mean`` in
``benchmarks/speculative.py``). vLLM also caps ``k`` by the room left
in ``max_model_len``; here the scheduler cuts every draft to the request's room.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """``Proposer`` (``spec/base.py``) by prompt lookup; ``1 <= min_n <= max_n``."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        total = len(token_ids)
        if k <= 0 or total < max(self.min_n, 2):  # a match needs an earlier occurrence
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidate occurrences end where the last token occurs earlier (position e <=
        # total - 2); extend each backwards while it still equals the suffix, up to max_n.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, self.max_n):
            alive &= ends >= j
            if not alive.any():
                break
            alive &= tokens[np.where(alive, ends - j, 0)] == tokens[total - 1 - j]
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return []
        end = int(ends[np.flatnonzero(length == best)[0]])  # the earliest of the longest
        return tokens[end + 1 : end + 1 + k].tolist()
