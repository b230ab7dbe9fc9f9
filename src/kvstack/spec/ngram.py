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

vLLM finds the match with a KMP scan of the reversed tokens (numba). Here each ``n``
from ``max_n`` down is one vectorized numpy comparison of all windows with the suffix;
the first ``n`` with a hit is the longest, its first hit the earliest: the same answer
(``tests/spec/test_ngram.py`` checks it against a transcription of vLLM's scan). Cost:
``O(L * max_n)`` element compares per proposal for ``L`` tokens, in C; measured by
``benchmarks/speculative.py`` (``propose_us``). vLLM also caps ``k`` by the room left
in ``max_model_len``; here the scheduler cuts every draft to the request's room.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        if k <= 0 or total < self.min_n + 1:  # a match needs an earlier occurrence
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        head = tokens[:-1]  # an occurrence must end before the last token
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            windows = sliding_window_view(head, n)  # [total - n, n], row s = tokens[s : s + n]
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start : start + k].tolist()
        return []
