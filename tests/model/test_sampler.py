"""Sampler tests: random logits, no model. Naive per-row loops serve as oracles.

Logits processing (penalties, logit_bias, min_tokens, allowed_token_ids, bad_words) is in
``test_logits_processors.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvstack.model.sampling.metadata import SamplingBatch, step_seed
from kvstack.model.sampling.sampler import (
    Sampler,
    apply_top_k,
    compute_prompt_logprobs,
    top_p_threshold,
)
from sampler_util import V, check_logprob_dict, mk, rand_logits, sample

# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = rand_logits(16, 1000)
    before = logits.clone()
    reqs = [mk(i, temperature=0.0, logit_bias={5: 0.0}) for i in range(16)]
    out = sample(logits, reqs)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16
    assert torch.equal(logits, before)


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, V), SamplingBatch.build([], V))
    assert out.sampled_token_ids == [] and out.logprobs == []


def test_batch_flags() -> None:
    b = SamplingBatch.build([mk(0, temperature=0.0), mk(1, temperature=0.0, top_k=3)], V)
    assert b.all_greedy and b.no_top_k and b.no_top_p and b.no_min_p and b.no_penalties
    assert not b.needs_logits_processing and b.output_token_counts is None
    assert b.max_num_logprobs is None and b.seeded == []
    b = SamplingBatch.build([mk(0, temperature=0.0), mk(1, top_k=3, seed=1, logprobs=2)], V)
    assert not b.all_greedy and not b.all_random and not b.no_top_k and b.no_top_p
    assert b.top_k.tolist() == [V, 3] and b.max_num_logprobs == 2 and len(b.seeded) == 1
    assert step_seed(1, 0) != step_seed(1, 1) != step_seed(2, 1)
    assert 0 <= step_seed(-(2**70), 3) < 2**63


def test_temperature_to_zero_limit() -> None:
    logits = rand_logits(32, 500)
    logits[torch.arange(32), logits.argmax(-1)] += 0.05  # top-1 gap >= 0.05 = 500 T
    before = logits.clone()
    out = sample(logits, [mk(i, temperature=1e-4) for i in range(32)])
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)  # the random path must not write into its input


def test_top_k_1_and_tiny_top_p_and_min_p_1_are_greedy() -> None:
    logits = rand_logits(24, 500, seed=3)
    reqs = [mk(i, temperature=1.5, top_k=1) for i in range(8)]
    reqs += [mk(i, temperature=1.5, top_p=1e-6) for i in range(8)]
    reqs += [mk(i, temperature=1.5, min_p=1.0) for i in range(8)]
    for trial in range(3):
        torch.manual_seed(trial)
        assert sample(logits, reqs).sampled_token_ids == logits.argmax(-1).tolist()


# ------------------------------------------------------------------- distributions


def oracle_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Naive single-row target distribution: temperature → top-k → top-p → min-p."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    pl = p.tolist()
    order = sorted(range(len(pl)), key=lambda j: -pl[j])
    keep = order[:top_k] if top_k else order
    mass = sum(pl[j] for j in keep)
    acc, nucleus = 0.0, []
    for j in keep:
        if acc < top_p * mass:
            nucleus.append(j)
            acc += pl[j]
    final = [j for j in nucleus if pl[j] >= min_p * pl[order[0]]]
    q = torch.zeros_like(p)
    q[final] = p[final]
    return q / q.sum()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.7},
        {"temperature": 1.0, "top_k": 6, "top_p": 0.9, "min_p": 0.1},
    ],
)
def test_sampling_frequencies_match_distribution(params: dict[str, Any]) -> None:
    v, rows, calls = 8, 10000, 2
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    reqs = [mk(i, **params) for i in range(rows)]
    batch = SamplingBatch.build(reqs, v)
    sampler = Sampler(generator=torch.Generator().manual_seed(1234))
    counts = torch.zeros(v)
    for _ in range(calls):
        ids = sampler(logits.expand(rows, v), batch).sampled_token_ids
        counts += torch.bincount(torch.tensor(ids), minlength=v)
    expected = oracle_probs(logits, **params) * rows * calls
    assert torch.all(counts[expected == 0] == 0), (counts, expected)
    support = expected > 0
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, counts, expected)


def truncate(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None):
    """Boolean [R, V] of the tokens the sampler's top-k then top-p keep."""
    z = x.clone() if top_k is None else apply_top_k(x.clone(), top_k)
    probs = torch.softmax(z, dim=-1)
    thr = 0.0 if top_p is None else top_p_threshold(probs, top_p).unsqueeze(1)
    return (probs > 0) & (probs >= thr)


def test_top_p_boundary_and_ties() -> None:
    probs = torch.tensor([[0.25, 0.5, 0.0, 0.25]] * 4)  # dyadic: sums are exact
    thr = top_p_threshold(probs, torch.tensor([0.5, 0.5000001, 0.75, 1.0]))
    assert thr.tolist() == [0.5, 0.25, 0.25, 0.0]  # mass 0.5 reaches p = 0.5; ties kept


@pytest.mark.parametrize("v", [40, 3000])  # 3000: all three top-p stages run
def test_top_k_top_p_masks_match_oracle(v: int) -> None:
    r = 12
    x = rand_logits(r, v, seed=5, scale=0.3 if v > 1000 else 3.0)
    top_k = torch.tensor([0, 1, 3, 10, 40, 50, 0, 0, 7, 2, 0, 40])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 1.0, 0.01, 0.99, 1.0, 0.6, 0.75, 0.999])
    k_eff = torch.where((top_k > 0) & (top_k < v), top_k, v)
    for use_k, use_p in [(True, False), (False, True), (True, True)]:
        got = truncate(x, k_eff if use_k else None, top_p if use_p else None)
        for i in range(r):
            kk = int(top_k[i]) if use_k else 0
            pp = float(top_p[i]) if use_p else 1.0
            want = oracle_probs(x[i], 1.0, top_k=kk if kk < v else 0, top_p=pp) > 0
            assert torch.equal(got[i], want), (i, use_k, use_p, got[i].sum(), want.sum())


def test_min_p_keeps_only_tokens_above_threshold() -> None:
    logits = rand_logits(1, 200, seed=9).expand(3000, 200)
    torch.manual_seed(0)
    ids = sample(logits, [mk(i, temperature=0.8, min_p=0.2) for i in range(3000)])
    p = torch.softmax(logits[0] / 0.8, dim=-1)
    allowed = set(torch.nonzero(p >= 0.2 * p.max()).flatten().tolist())
    assert set(ids.sampled_token_ids) <= allowed
    assert len(set(ids.sampled_token_ids)) > 1


# --------------------------------------------------------------------------- seeds


def run_seeded(steps: int, pos: int, others: list[dict[str, Any]], start: list[int]) -> list[int]:
    """Generate ``steps`` tokens for one seeded request placed at row ``pos`` among others."""
    params: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    out = list(start)
    for _ in range(steps):
        step = len(out)
        logits = rand_logits(1, 300, seed=100 + step, scale=1.0)
        reqs = [mk(i + 1, output=[0] * step, **o) for i, o in enumerate(others)]
        reqs.insert(pos, mk(0, output=out, **params))
        full = torch.cat([rand_logits(len(others), 300, seed=step), logits])
        order = list(range(len(others)))
        order.insert(pos, len(others))
        out.append(sample(full[order], reqs).sampled_token_ids[pos])
    return out


def test_seed_reproducible_across_batch_composition_and_preemption() -> None:
    alone = run_seeded(12, 0, [], [])
    noisy = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.5, "top_k": 3, "seed": 7},
        {"temperature": 1.2, "min_p": 0.1, "presence_penalty": 1.0},
    ]
    torch.manual_seed(99)  # unseeded rows must not disturb the seeded stream
    assert run_seeded(12, 2, noisy, []) == alone
    assert run_seeded(12, 4, noisy[::-1], []) == alone
    # "Preempted" after 5 tokens and recomputed: resumes with the same stream.
    assert run_seeded(7, 1, noisy[:2], alone[:5]) == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(30, 1000)
    ids = sample(logits, [mk(i, seed=i) for i in range(30)]).sampled_token_ids
    assert len(set(ids)) > 20
    again = sample(logits, [mk(i, seed=i) for i in range(30)]).sampled_token_ids
    assert ids == again
    # One seed at successive output positions draws fresh noise each step.
    steps = sample(logits, [mk(0, seed=3, output=[0] * i) for i in range(30)]).sampled_token_ids
    assert len(set(steps)) > 20


# ------------------------------------------------------------------------ logprobs


def test_logprobs_values_ranks_and_order() -> None:
    logits = rand_logits(5, 500, seed=21)
    reqs = [
        mk(0, temperature=0.0, logprobs=5),
        mk(1, temperature=2.0, logprobs=0),  # logprobs are before temperature
        mk(2, temperature=1.0),
        mk(3, temperature=1.0, top_k=50, logprobs=20, seed=3),
        mk(4, temperature=0.5, logprobs=3, logit_bias={11: 5.0}),
    ]
    processed = logits.clone()
    processed[4, 11] += 5.0
    lp = torch.log_softmax(processed, dim=-1)
    out = sample(logits, reqs)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 20), (4, 3)]:
        check_logprob_dict(out.logprobs[i], lp[i], out.sampled_token_ids[i], n)
    d0 = out.logprobs[0]
    assert d0 is not None and d0[out.sampled_token_ids[0]].rank == 1 and len(d0) == 5


def test_compute_prompt_logprobs() -> None:
    logits = rand_logits(37, 300, seed=8)
    targets = torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(1))
    lp = torch.log_softmax(logits, dim=-1)
    got = compute_prompt_logprobs(logits, targets, 4, chunk_size=10)
    assert got == compute_prompt_logprobs(logits, targets.tolist(), 4)
    assert len(got) == 37
    for i, d in enumerate(got):
        check_logprob_dict(d, lp[i], int(targets[i]), 4)
    assert all(len(d) == 1 for d in compute_prompt_logprobs(logits, targets, 0))


# --------------------------------------------------------------------- robustness


def test_mixed_batch_greedy_random_seeded() -> None:
    logits = rand_logits(9, 400, seed=30)
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 5},
        {"temperature": 0.8},
        {"temperature": 0.0, "seed": 5},
        {"temperature": 1.1, "top_k": 20, "seed": 6},
        {"temperature": 0.9, "top_p": 0.8},
        {"temperature": 0.0, "repetition_penalty": 1.3},
        {"temperature": 0.7, "min_p": 0.05, "seed": 5, "logprobs": 2},
        {"temperature": 1e-6},
    ]
    reqs = [mk(i, **k) for i, k in enumerate(kinds)]
    first = sample(logits, reqs).sampled_token_ids
    argmax = logits.argmax(-1).tolist()
    for i in (0, 3, 8):
        assert first[i] == argmax[i]
    for trial in range(3):
        torch.manual_seed(trial)
        again = sample(logits, reqs).sampled_token_ids
        for i in (0, 1, 3, 4, 7, 8):
            assert again[i] == first[i]
    alone = sample(logits[[1, 4, 7]], [reqs[1], reqs[4], reqs[7]]).sampled_token_ids
    assert alone == [first[1], first[4], first[7]]


def test_no_nan_with_extreme_logits() -> None:
    inf, nan = float("inf"), float("nan")
    logits = torch.cat([rand_logits(4, seed=1), torch.full((2, V), 3.0e38)])
    logits[0] = -inf
    logits[0, 17] = 0.0  # all but one masked
    logits[1] = -inf  # nothing finite
    logits[2, 3] = logits[2, 4] = inf
    logits[3, 9] = nan
    logits[4] = rand_logits(1, seed=3)[0] * 1e37  # ±1e38-scale values
    logits[5, ::2] = -3.0e38
    configs: list[dict[str, Any]] = [
        {"temperature": 1.0},
        {"temperature": 1e-5, "top_p": 0.5, "top_k": 3, "min_p": 0.5},
        {"temperature": 0.0},
        {"temperature": 100.0, "repetition_penalty": 0.1, "frequency_penalty": 2.0},
        {"temperature": 0.5, "logit_bias": {t: -100.0 for t in range(V)}, "seed": 1},
    ]
    for cfg in configs:
        reqs = [mk(i, output=[17, 3, 3], logprobs=3, **cfg) for i in range(6)]
        for trial in range(3):
            torch.manual_seed(trial)
            out = sample(logits, reqs)
            assert out.sampled_token_ids[0] == 17
            assert out.sampled_token_ids[2] in (3, 4)
            for d in out.logprobs:
                assert d is not None
                assert all(not math.isnan(v.logprob) for v in d.values())
                assert all(v.logprob <= 1e-6 for v in d.values())
    bad = compute_prompt_logprobs(logits, [17] * 6, 2)
    assert all(not math.isnan(v.logprob) for d in bad for v in d.values())


def test_shape_mismatch_is_an_error() -> None:
    batch = SamplingBatch.build([mk(0)], V)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, V), batch)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, V + 1), batch)


@pytest.mark.parametrize("top_p", [5e-324, 1e-320, 1e-46, 1e-45, 1e-38])
def test_top_p_that_float32_rounds_to_zero_keeps_the_most_likely(top_p: float) -> None:
    # A top_p in (0, 1] is valid (vLLM accepts it); below float32's smallest subnormal it
    # reached the sampler as 0 and kept no token: index -1, the step failed.
    logits = rand_logits(8, 500, seed=5)
    probs = torch.softmax(logits, dim=-1)
    thr = top_p_threshold(probs, torch.tensor([top_p] * 8))
    assert torch.equal(thr, probs.amax(dim=-1))
    reqs = [mk(i, temperature=1.0, top_p=top_p, seed=i if i % 2 else None) for i in range(8)]
    assert sample(logits, reqs).sampled_token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [3.4e38, 1e39, 1e308, 2.0**70])
def test_huge_temperature_never_samples_a_masked_token(temperature: float) -> None:
    # Past float32's max the temperature was inf: -inf / inf = NaN for every masked
    # token, the row's probabilities all NaN, and token 0 (not allowed) came out.
    logits = rand_logits(4, seed=6)
    for trial in range(8):
        torch.manual_seed(trial)
        reqs = [mk(i, temperature=temperature, allowed_token_ids=[5, 6]) for i in range(4)]
        reqs[1] = mk(1, temperature=temperature, logit_bias={t: -100.0 for t in range(V - 1)})
        out = sample(logits, reqs).sampled_token_ids
        assert out[0] in (5, 6) and out[2] in (5, 6) and out[3] in (5, 6), out
