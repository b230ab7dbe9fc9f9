"""Rejection sampling of point-mass drafts (``model/sampling/rejection.py``).

Leviathan et al. 2023 / Chen et al. 2023 with a deterministic draft ``x``: keep ``x``
with probability ``p(x)``, else sample ``p`` without ``x``; the kept token is then
distributed exactly as ``p``. Checked with a chi-square test (fixed seed, so the test is
deterministic) on a tiny vocabulary, against the analytic target distribution.
"""

from __future__ import annotations

import math

import torch

from kvstack.core.request import Request, SamplingParams
from kvstack.model.sampling.metadata import SamplingBatch
from kvstack.model.sampling.rejection import RejectionSampler, greedy_run
from kvstack.model.sampling.sampler import Sampler

V = 6
# chi-square critical value for 5 degrees of freedom at p = 0.001
CHI2_5_999 = 20.515


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def request(sp: SamplingParams, rid: str = "r") -> Request:
    return Request(rid, [1, 2, 3], sp)


def test_greedy_keeps_the_matching_prefix_and_one_token() -> None:
    assert greedy_run([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept + bonus
    assert greedy_run([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # correction at the first miss
    assert greedy_run([4, 6, 7, 8], [5, 6, 7]) == [4]
    sampler = RejectionSampler(Sampler())
    logits = torch.full((4, V), -5.0)
    for row, tok in enumerate([2, 3, 1, 0]):
        logits[row, tok] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert sampler(logits, [(request(greedy), [2, 3, 4])]) == [[2, 3, 1]]


def test_random_rows_keep_the_target_distribution() -> None:
    torch.manual_seed(1234)
    logits = torch.tensor(
        [[1.0, 0.5, 0.0, -0.5, 2.0, 0.2], [0.1, 1.5, -1.0, 0.3, 0.0, 0.8], [0.0] * V]
    )
    temperature = 0.8
    p = torch.softmax(logits / temperature, dim=-1)
    draft = [4, 1]  # likely first guess, then a mid-probability one
    sp = SamplingParams(temperature=temperature)
    n = 6000
    drafts = [(request(sp, f"r{i}"), list(draft)) for i in range(n)]
    runs = RejectionSampler(Sampler())(logits.repeat(n, 1), drafts)
    first = [0] * V
    second = [0] * V
    for run in runs:
        first[run[0]] += 1
        if run[0] == draft[0]:
            second[run[1]] += 1
    # The first token is p0-distributed; after accepting d1, the second is p1-distributed.
    assert chi_square(first, p[0].tolist()) < CHI2_5_999
    assert chi_square(second, p[1].tolist()) < CHI2_5_999
    accepted_first = sum(1 for r in runs if len(r) > 1)
    assert abs(accepted_first / n - float(p[0, 4])) < 4 * math.sqrt(0.25 / n)


def test_top_k_and_zero_probability_drafts() -> None:
    torch.manual_seed(7)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0], [0.0] * V])
    sp = SamplingParams(temperature=1.0, top_k=2)
    n = 3000
    drafts = [(request(sp, f"r{i}"), [5]) for i in range(n)]  # outside the top-2: p = 0
    runs = RejectionSampler(Sampler())(logits.repeat(n, 1), drafts)
    assert all(len(r) == 1 for r in runs)  # never accepted
    p = torch.softmax(logits[0, :2], dim=-1).tolist() + [0.0] * 4
    counts = [sum(1 for r in runs if r[0] == t) for t in range(V)]
    assert counts[2:] == [0] * 4
    assert chi_square(counts[:2], p[:2]) < 10.83  # 1 degree of freedom, p = 0.001


def test_seeded_requests_get_the_samplers_own_tokens_in_any_batch() -> None:
    """A seeded row's target is the token ``Sampler`` draws at that output position, so a
    seeded request samples the same tokens with and without speculation."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    req = request(sp)
    plain: list[int] = []
    for row in range(3):  # one-token steps: the sampler at output positions 0, 1, 2
        r = Request("r", [1, 2, 3], sp, output_token_ids=list(plain))
        plain += Sampler()(logits[row : row + 1], SamplingBatch.build([r], V)).sampled_token_ids
    wrong = (plain[1] + 1) % V
    assert RejectionSampler(Sampler())(logits, [(req, [plain[0], plain[1]])]) == [plain]
    assert RejectionSampler(Sampler())(logits[:2], [(req, [plain[0]])]) == [plain[:2]]
    assert RejectionSampler(Sampler())(logits, [(req, [plain[0], wrong])]) == [plain[:2]]
    other = (request(SamplingParams(temperature=0.7), "o"), [3])
    noise = torch.randn(2, V)
    mixed = RejectionSampler(Sampler())(torch.cat([noise, logits]), [other, (req, plain[:2])])
    assert mixed[1] == plain
