"""Shared pieces of the sampler tests: requests with validated sampling parameters,
random logits, sampling one batch with a fresh ``Sampler``, and the check of a logprobs
dict against log-softmax."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvstack.core.request import Request, SamplingParams
from kvstack.model.sampling.metadata import SamplingBatch
from kvstack.model.sampling.sampler import Sampler, SamplerOutput

V = 64


def mk(i: int = 0, *, prompt: list[int] | None = None, output: list[int] | None = None,
       eos: frozenset[int] = frozenset(), **sp: Any) -> Request:  # fmt: skip
    """A request with the given (validated) sampling parameters and token history."""
    params = SamplingParams(max_tokens=1000, **sp)
    params.validate(vocab_size=V)
    prompt = [1, 2, 3] if prompt is None else prompt
    return Request(str(i), prompt, params, eos_token_ids=eos, output_token_ids=list(output or []))


def sample(logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
    """Build the batch, sample with a fresh Sampler, check the output's shape and id range."""
    out = Sampler()(logits, SamplingBatch.build(reqs, logits.shape[1]))
    assert len(out.sampled_token_ids) == len(reqs) == len(out.logprobs)
    assert all(0 <= t < logits.shape[1] for t in out.sampled_token_ids)
    return out


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def check_logprob_dict(d: Any, lp_row: torch.Tensor, sampled: int, n: int) -> None:
    assert d is not None
    keys = list(d)
    assert keys[0] == sampled
    want_rank = int((lp_row > lp_row[sampled]).sum()) + 1
    assert d[sampled].rank == want_rank
    top = lp_row.topk(n).indices.tolist() if n else []
    assert set(keys) == {sampled, *top}
    for j, t in enumerate(top):
        assert d[t].rank == j + 1
    vals = [d[t].logprob for t in top]
    assert vals == sorted(vals, reverse=True)
    for t, item in d.items():
        assert item.logprob == pytest.approx(float(lp_row[t]), abs=1e-5)
