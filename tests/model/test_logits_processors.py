"""Logits processing before sampling (random logits, no model; naive loops as oracles):
presence / frequency / repetition penalties, logit_bias, min_tokens, allowed_token_ids and
bad_words, and the validation of vLLM's extra sampling parameters."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import Request, SamplingParams
from kvstack.model.sampling.metadata import SamplingBatch, bad_word_bans
from kvstack.model.sampling.sampler import Sampler, apply_logits_processors
from sampler_util import V, check_logprob_dict, mk, rand_logits, sample

# ------------------------------------------------------------- logits processing


def naive_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        for tok in set(r.prompt_token_ids) | set(r.output_token_ids):
            x = float(out[i, tok])
            out[i, tok] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
        for tok in set(r.output_token_ids):
            n = r.output_token_ids.count(tok)
            out[i, tok] -= sp.frequency_penalty * n + sp.presence_penalty
    return out


def test_penalties_match_naive_oracle() -> None:
    g = torch.Generator().manual_seed(11)
    pens = [(0.0, 0.0, 1.0), (1.5, 0.0, 1.0), (0.0, -0.7, 1.0), (0.0, 0.0, 1.8), (-1, 2, 0.6)]
    reqs = [
        mk(
            i,
            prompt=torch.randint(0, V, (20,), generator=g).tolist(),
            output=torch.randint(0, V, (15,), generator=g).tolist(),
            temperature=0.0,
            logprobs=20,
            presence_penalty=pres,
            frequency_penalty=freq,
            repetition_penalty=rep,
        )
        for i, (pres, freq, rep) in enumerate(pens)
    ]
    logits = rand_logits(len(reqs), seed=12)
    want = naive_penalties(logits, reqs)
    assert all(not torch.equal(want[i], logits[i]) for i in range(1, len(reqs)))
    batch = SamplingBatch.build(reqs, V)
    got = apply_logits_processors(logits, batch)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)  # (assert_close imports sympy: 1 s)
    out = Sampler()(logits, batch)
    assert out.sampled_token_ids == want.argmax(-1).tolist()
    want_lp = torch.log_softmax(want, dim=-1)
    for i, d in enumerate(out.logprobs):
        check_logprob_dict(d, want_lp[i], out.sampled_token_ids[i], 20)


def test_logit_bias_forces_and_bans() -> None:
    logits = rand_logits(6, seed=2, scale=1.0)
    best = logits.argmax(-1).tolist()
    reqs = [
        mk(0, temperature=0.0, logit_bias={7: 100.0}),
        mk(1, temperature=1.0, logit_bias={9: 100.0}),
        mk(2, temperature=0.0, logit_bias={best[2]: -100.0}),
        mk(3, temperature=1.0, logit_bias={t: -100.0 for t in range(V) if t != 4}),
        mk(4, temperature=0.0),
        mk(5, temperature=2.0, top_p=0.5, logit_bias={t: -100.0 for t in range(V - 1)}),
    ]
    for trial in range(5):
        torch.manual_seed(trial)
        ids = sample(logits, reqs).sampled_token_ids
        assert ids[0] == 7 and ids[1] == 9 and ids[3] == 4 and ids[5] == V - 1
        assert ids[2] == int(logits[2].index_fill(0, torch.tensor(best[2]), -1e9).argmax())
        assert ids[4] == best[4]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    eos = frozenset({5})
    logits = rand_logits(1, seed=4, scale=1.0)
    logits[0, 5], logits[0, 6], logits[0, 8] = 50.0, 40.0, 30.0  # eos, stop token, runner-up

    def pick(n_out: int, **kw: Any) -> int:
        r = mk(0, output=[1] * n_out, eos=eos, temperature=0.0, **kw)
        return sample(logits, [r]).sampled_token_ids[0]

    assert pick(0) == 5
    assert pick(2, min_tokens=3, stop_token_ids=[6]) == 8
    assert pick(3, min_tokens=3, stop_token_ids=[6]) == 5
    assert pick(2, min_tokens=3) == 6  # 6 is not a stop token here
    assert pick(2, min_tokens=3, ignore_eos=True, stop_token_ids=[6]) == 5
    banned = apply_logits_processors(
        logits, SamplingBatch.build([mk(0, output=[1], eos=eos, min_tokens=2)], V)
    )
    assert banned[0, 5] == float("-inf") and torch.equal(banned[0, :5], logits[0, :5])
    torch.manual_seed(0)
    r = mk(0, eos=eos, min_tokens=1, temperature=1.0, logprobs=0)
    out = sample(logits, [r])
    d = out.logprobs[0]
    assert out.sampled_token_ids[0] != 5
    assert d is not None and math.isfinite(d[out.sampled_token_ids[0]].logprob)


# ------------------------------------------------------- allowed_token_ids, bad_words


def test_allowed_token_ids_restrict_every_row_that_sets_them() -> None:
    logits = rand_logits(3, seed=11)
    allowed = [7, 3, 60]
    reqs = [
        mk(0, temperature=0.0, allowed_token_ids=allowed),
        mk(1, temperature=0.0),
        mk(2, temperature=1.0, allowed_token_ids=[9], seed=3, logprobs=2),
    ]
    batch = SamplingBatch.build(reqs, V)
    assert batch.needs_logits_processing and batch.allowed_tokens is not None
    x = apply_logits_processors(logits, batch)
    assert torch.isfinite(x[0, allowed]).all() and torch.isneginf(x[0]).sum() == V - 3
    assert torch.equal(x[1], logits[1])
    out = sample(logits, reqs)
    assert out.sampled_token_ids[0] == max(allowed, key=lambda t: float(logits[0, t]))
    assert out.sampled_token_ids[1] == int(logits[1].argmax())
    assert out.sampled_token_ids[2] == 9
    lp = out.logprobs[2]
    assert lp is not None and lp[9].logprob == pytest.approx(0.0)
    for _ in range(20):  # random rows never leave the allowed set
        ids = sample(rand_logits(1, seed=_), [mk(0, temperature=2.0, allowed_token_ids=allowed)])
        assert ids.sampled_token_ids[0] in allowed


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [V]}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": ["x"] * 129}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_vllm_extras_are_validated_with_their_param(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as e:
        SamplingParams(**bad).validate(vocab_size=V)
    assert e.value.param == match


def test_bad_words_ban_the_last_token_only_after_the_others() -> None:
    assert bad_word_bans([[5], [1, 2, 9], [3, 4]], []) == [5]
    assert bad_word_bans([[5], [1, 2, 9], [3, 4]], [7, 1, 2]) == [5, 9]
    assert bad_word_bans([[5], [1, 2, 9], [3, 4]], [1, 2, 3]) == [5, 4]
    assert bad_word_bans([[1, 2, 9]], [2]) == []
    logits = rand_logits(2, seed=5)
    logits[:, 9] = 100.0
    reqs = [mk(0, output=[1, 2], temperature=0.0), mk(1, output=[1, 2], temperature=0.0)]
    reqs[0].sampling_params.bad_words_token_ids = [[1, 2, 9]]
    out = sample(logits, reqs)
    assert out.sampled_token_ids[0] != 9 and out.sampled_token_ids[1] == 9
    reqs[0].output_token_ids = [2, 1]  # the prefix no longer matches: 9 is fine again
    assert sample(logits, reqs).sampled_token_ids[0] == 9


def test_resolve_bad_words_adds_the_leading_space_variant() -> None:
    vocab = {"hello": [10, 11], " hello": [12, 11], "x": [20], " x": [21, 20], "y": [30]}
    sp = SamplingParams(bad_words=["hello", " x", "y"])
    sp.resolve_bad_words(lambda w: vocab.get(w, [30]), vocab_size=V)
    # " x" encodes to 2 tokens, "x" to one: vLLM keeps only the plain form.
    assert sp.bad_words_token_ids == [[10, 11], [12, 11], [20], [30]]
    with pytest.raises(InvalidRequestError, match="no tokens"):
        SamplingParams(bad_words=["z"]).resolve_bad_words(lambda w: [], vocab_size=V)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        SamplingParams(bad_words=["z"]).resolve_bad_words(lambda w: [V + 1], vocab_size=V)


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    ids = list(range(10))
    assert SamplingParams(truncate_prompt_tokens=3).truncate_prompt(ids, 100) == [7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt(ids, 4) == [6, 7, 8, 9]
    assert SamplingParams().truncate_prompt(ids, 4) == ids
    with pytest.raises(InvalidRequestError, match="max_model_len") as e:
        SamplingParams(truncate_prompt_tokens=50).truncate_prompt(ids, 20)
    assert e.value.param == "truncate_prompt_tokens"
