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

vLLM finds the match with a KMP scan of the reversed tokens (numba). Here ``list.index``
(a C scan) walks the earlier occurrences of the last token from the first on, and each is
extended backwards while it equals the suffix, up to ``max_n``; the first occurrence
reaching a length stays (the earliest among equals), and reaching ``max_n`` ends the
scan: the same answer (``tests/spec/test_ngram.py`` checks it against a transcription of
vLLM's scan). Cost: a scan of the ``L`` tokens plus a few compares per occurrence,
4.6 us at L = 520-768 on the open prompt of ``benchmarks/latency.py`` and 6.0 us on its
repetitive one (a numpy version, vectorized over the occurrences: 9.0 and 15.6 us, its
per-op overhead; ``propose_us_mean`` in ``benchmarks/speculative.py``). vLLM also caps
``k`` by the room left in ``max_model_len``; here the scheduler cuts every draft to the
request's room.
"""

from __future__ import annotations

from collections.abc import Sequence


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
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        last, max_n, find = tokens[-1], self.max_n, tokens.index
        best, best_end, end = 0, -1, -1
        while best < max_n:  # the earliest occurrence of the longest length found first
            try:  # the next earlier occurrence of the last token (a C scan), e <= total - 2
                end = find(last, end + 1, total - 1)
            except ValueError:
                break
            n = 1  # extend it backwards while it equals the suffix, up to max_n
            while n < max_n and n <= end and tokens[end - n] == tokens[total - 1 - n]:
                n += 1
            if n > best:  # strictly longer: among equals the earliest stays
                best, best_end = n, end
        if best < self.min_n:
            return []
        return tokens[best_end + 1 : best_end + 1 + k]
