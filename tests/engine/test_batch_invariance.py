"""bf16 batch invariance on CPUs whose linear kernel takes every input
(``TileKernel.batch_invariant``, ``model/kernels/packed_linear.py``): a request's logits do not
depend on its batch mates, its chunk sizes, a prefix hit, or (segment reuse) whether a
segment copy was recomputed in full. Bitwise, not within a tolerance.

Not covered, by design: attention itself. A chunk of at most ``KERNEL_CHUNK_ROWS`` rows
(and every decode) is scored by the paged decode kernel, a longer one by the causal
prefill kernel, and the two sum in different orders; so a prompt whose last chunk is
that short still rounds differently from the same prompt in one step.

Each case fails on the routing before 2026-12-05 (inputs over 64 / 192 rows to oneDNN,
whose summation order differs): the long batch mate, the one-step prefill and the segment
copy's recompute put the same rows into steps of other sizes."""

from __future__ import annotations

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.model.attention import KERNEL_CHUNK_ROWS, causal_kernel_takes
from kvstack.model.kernels import packed_linear
from kvstack.model.kernels.loader import load_kernels

LONG = " ".join(["The history of the world is long and full of wars."] * 30)
OPTS = {"dtype": "bfloat16", "num_blocks": 256}


@pytest.fixture(scope="module", autouse=True)
def invariant_kernel() -> None:
    """Run where this was measured: a batch-invariant linear kernel and the C++ causal
    prefill kernel (AVX512-BF16); without it bf16 prefill attention is PyTorch's SDPA,
    whose rounding by shape these tests do not cover."""
    kern = packed_linear.tile_kernel()
    if kern is None or not kern.batch_invariant:
        pytest.skip(f"bf16 routing splits by rows on this CPU ({kern.name if kern else 'none'})")
    if not causal_kernel_takes(load_kernels(), torch.bfloat16, 64):
        pytest.skip("no C++ causal prefill kernel on this CPU (bf16 prefill runs SDPA)")


def test_batch_mates_change_no_bit() -> None:
    """Greedy text and logprobs of one request, alone and beside a 330-token prompt
    (a 400-row prefill step) and seven short ones."""
    llm = LLM("default", prefix_cache="none", **OPTS)
    mates = [LONG, "1, 2, 3, 4,", "def fibonacci(n):", "Hello, my name is", "The quick fox",
             "Explain gravity:", "Once upon a time", "The capital of Peru is"]  # fmt: skip
    prompt = "Write a poem about the sea and the sky and the long night that"
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    alone = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    beside = llm.generate([*mates[:1], prompt, *mates[1:]], sp, use_tqdm=False)[1].outputs[0]
    assert beside.token_ids == alone.token_ids
    for t, a, b in zip(alone.token_ids, alone.logprobs, beside.logprobs, strict=True):
        assert a[t].logprob == b[t].logprob


def test_chunks_and_prefix_hits_change_no_bit() -> None:
    """A 330-token prompt in one step, in 48-token chunks, and after a prefix hit of its
    first 256 tokens: the same prompt logprobs, greedy tokens and logprobs."""
    one = LLM("default", prefix_cache="none", **OPTS)
    ids = one.tokenizer.encode(LONG)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    ref_lp = one.score(ids, start=1)
    ref = one.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)
    del one
    chunked = LLM("default", prefix_cache="none", max_num_batched_tokens=48, **OPTS)
    assert torch.equal(chunked.score(ids, start=1), ref_lp)
    del chunked
    cached = LLM("default", **OPTS)
    cached.generate(prompt_token_ids=[ids[:256]], sampling_params=sp, use_tqdm=False)
    got = cached.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)
    assert cached.engine.stats().prefix_hit_tokens >= 256
    a, b = ref[0].outputs[0], got[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert [x[t].logprob for x, t in zip(a.logprobs, a.token_ids, strict=True)] == [
        x[t].logprob for x, t in zip(b.logprobs, b.token_ids, strict=True)
    ]


def test_segment_copy_recomputed_in_full_equals_full_prefill() -> None:
    """Segment reuse's ``segment_recompute_ratio = 1``: in bf16 too, the same logits as a plain
    prefill (before 2026-12-05: KL 0.002, top-1 0.98 over 24 requests). The text before
    and after the segments is longer than ``KERNEL_CHUNK_ROWS``, so every row takes the
    causal prefill kernel in both runs (see the module docstring)."""
    full = LLM("default", prefix_cache="none", segment_cache="none", **OPTS)
    tok = full.tokenizer
    head = tok.encode(
        "You are a helpful assistant working for a travel agency. Answer briefly, be "
        "polite, never invent facts, and call a tool whenever the answer depends on live "
        "data such as the weather, prices, opening hours or the news. "
        * 2
        + "You may call the following tools:"
    )
    seg_a = tok.encode(
        ' {"name": "get_weather", "description": "The forecast for a city: temperature, '
        'wind and rain for the next three days.", "parameters": {"city": "string", '
        '"unit": "celsius or fahrenheit"}}'
    )
    seg_b = tok.encode(
        ' {"name": "search", "description": "Web results for a query, newest first, with '
        'a title and a short summary each.", "parameters": {"query": "string", "limit": '
        '"integer"}}'
    )
    tail = tok.encode(" User: what is the weather in Oslo today, and will it rain? Assistant:")
    assert min(len(head), len(tail)) > KERNEL_CHUNK_ROWS
    # one 200+-row step in full; at most ~150 rows a step with segments
    assert len(head) + len(seg_a) + len(seg_b) + len(tail) > 192
    ids = head + seg_a + seg_b + tail
    a0, b0 = len(head), len(head) + len(seg_a)
    marks = [[a0, b0], [b0, b0 + len(seg_b)]]
    start = b0 + len(seg_b) + 1  # (the copied positions have no prompt logprobs)
    ref = full.score(ids, start=start)
    seg = LLM("default", segment_recompute_ratio=1.0, **OPTS)
    seg.score(ids, start=start, segments=marks)  # computes the entries
    before = seg.engine.stats().segments
    got = seg.score(ids, start=start, segments=marks)  # copies and recomputes
    after = seg.engine.stats().segments
    assert after["computed_tokens"] == before["computed_tokens"]  # every entry was a hit
    assert after["placed_tokens"] - before["placed_tokens"] == len(seg_a) + len(seg_b)
    assert torch.equal(got, ref)
    seg.engine.kv_manager.check_integrity()
