"""Prompt lookup (``spec/ngram.py``) against vLLM's rule, and ``--speculative-config``."""

from __future__ import annotations

import random

import pytest

from kvstack.core.errors import ConfigError
from kvstack.spec import PROPOSERS, build_proposer
from kvstack.spec.config import SpeculativeConfig, parse_speculative_config
from kvstack.spec.ngram import NgramProposer


def vllm_find_longest_matched_ngram(
    tokens_in: list[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int
) -> list[int]:
    """vLLM 0.32's ``_find_longest_matched_ngram_and_propose_tokens``
    (``vllm/v1/spec_decode/ngram_proposer.py``), transcribed line by line from numba to
    Python: a KMP scan of the reversed tokens."""
    total_token = len(tokens_in)
    if total_token < min_ngram:
        return []
    k = min(k, max_model_len - total_token)
    if k <= 0:
        return []
    tokens = tokens_in[::-1]
    lps = [0] * max_ngram
    longest_ngram = 0
    position = 0
    prev_lps = 0
    i = 1
    while i < total_token:
        if tokens[prev_lps] == tokens[i]:
            prev_lps += 1
            if prev_lps >= longest_ngram:
                longest_ngram = prev_lps
                position = i
            if i < max_ngram:
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest_ngram < min_ngram:
        return []
    start_position = total_token - 1 - position + longest_ngram
    k = min(k, total_token - start_position)
    return tokens_in[start_position : start_position + k]


def test_matches_vllms_scan_on_random_sequences() -> None:
    rng = random.Random(0)
    proposals = 0
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        n = rng.randint(0, 60)
        tokens = [rng.randrange(vocab) for _ in range(n)]
        if rng.random() < 0.3 and n > 4:  # repeated spans, as in code or quoted text
            cut = rng.randint(1, n - 1)
            tokens += tokens[rng.randint(0, cut - 1) : cut]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        want = vllm_find_longest_matched_ngram(tokens, lo, hi, 10**6, k)
        got = NgramProposer(lo, hi).propose(tokens, k)
        assert got == want, (tokens, lo, hi, k)
        proposals += bool(want)
    assert proposals > 1000  # the comparison covered real proposals, not only empty ones


def test_longest_then_earliest_match() -> None:
    p = NgramProposer(1, 4)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3]
    assert p.propose(tokens, 2) == [9, 7]  # "1 2 3" (n=3) beats the later "2 3" match
    assert p.propose([4, 5, 6, 4, 5, 7, 4, 5], 3) == [6, 4, 5]  # earliest of two "4 5"
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert p.propose([5, 5], 3) == [5]  # overlapping the suffix; the draft ends at the end
    assert NgramProposer(3, 3).propose([1, 2, 1, 2], 2) == []  # shorter than min_n matches


def test_config_defaults_follow_vllm() -> None:
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert c == SpeculativeConfig("ngram", 4, prompt_lookup_max=5, prompt_lookup_min=5)
    c = parse_speculative_config({"method": "[ngram]", "num_speculative_tokens": 2,
                                  "prompt_lookup_max": 3})  # fmt: skip
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_min": 2})  # fmt: skip
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert parse_speculative_config(c) is c and parse_speculative_config(None) is None
    assert isinstance(build_proposer(c), NgramProposer)
    assert PROPOSERS.names() == ("ngram", "draft_model")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
        ({"method": "ngram", "num_speculative_tokens": -2}, "positive integer"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "positive integer"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 3}, "method"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
         "unsupported field"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0,
          "prompt_lookup_max": 2}, "prompt_lookup_min must be an integer >= 1"),
    ],
)  # fmt: skip
def test_bad_configs_are_one_clear_error(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_speculative_config(value)


def test_the_draft_length_follows_what_was_accepted() -> None:
    """``next_draft_len``: all kept doubles the draft (at most k), else one more than
    kept; the speculator asks the proposer for that many on the request's next step."""
    from kvstack.core.request import Request, SamplingParams
    from kvstack.sched.output import ScheduledRequest
    from kvstack.spec.speculator import Speculator, next_draft_len

    assert [next_draft_len(8, a, 8) for a in (0, 3, 7, 8)] == [1, 4, 8, 8]
    assert [next_draft_len(n, n, 8) for n in (1, 2, 3, 4, 5)] == [2, 4, 6, 8, 8]
    spec = Speculator(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 8}))
    req = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3, SamplingParams(temperature=0.0))
    step = ScheduledRequest(req, 29, 9, [0], [1, 2, 3, 4, 5, 6, 7, 8])
    spec.after_step([step], {"r": []}, [req])  # nothing of 8 kept: next draft 1 token
    assert req.spec_draft_len == 1 and len(req.spec_token_ids) == 1
    step = ScheduledRequest(req, 29, 2, [0], req.spec_token_ids)
    spec.after_step([step], {"r": list(req.spec_token_ids)}, [req])  # all kept: twice
    assert req.spec_draft_len == 2 and len(req.spec_token_ids) == 2
    step = ScheduledRequest(req, 29, 3, [0], req.spec_token_ids)
    spec.after_step([step], {"r": list(req.spec_token_ids)}, [req])
    assert req.spec_draft_len == 4 and len(req.spec_token_ids) == 4
    assert spec.stats.num_draft_tokens == 11 and spec.stats.num_accepted_tokens == 3


def test_repeated_misses_pause_proposals() -> None:
    """Two verifies in a row that keep nothing pause proposing for 1 step, then 2, 4, 8
    (at most); one kept draft ends the pause."""
    from kvstack.core.request import Request, SamplingParams
    from kvstack.sched.output import ScheduledRequest
    from kvstack.spec.speculator import MAX_PAUSE, Speculator, pause_after

    assert [pause_after(m) for m in range(1, 8)] == [0, 1, 2, 4, 8, 8, 8] and MAX_PAUSE == 8
    spec = Speculator(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4}))
    req = Request("r", [1, 2, 3, 4] * 6, SamplingParams(temperature=0.0))
    drafted = []
    for _ in range(12):  # every draft is rejected
        step = ScheduledRequest(req, 23, 1 + len(req.spec_token_ids), [0], req.spec_token_ids)
        spec.after_step([step], {"r": []}, [req])
        drafted.append(bool(req.spec_token_ids))
    # misses 1, 2 -> pause 1; miss 3 -> pause 2; miss 4 -> pause 4
    assert drafted == [True, True, False, True, False, False, True] + [False] * 4 + [True]
    step = ScheduledRequest(req, 23, 2, [0], req.spec_token_ids)
    spec.after_step([step], {"r": list(req.spec_token_ids)}, [req])  # kept: no pause
    assert req.spec_misses == 0 and req.spec_pause == 0 and req.spec_token_ids
