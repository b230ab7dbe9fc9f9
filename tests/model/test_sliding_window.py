"""Sliding-window attention against transformers: tiny random Mistral (every layer slides,
W = 8) and Qwen2 (layer 1 slides) models, prompts longer than the window, fp32.

Logits of a prompt run whole and in chunks shorter and longer than the window (PyTorch
path and C++ kernels) are within ``LOGIT_ATOL`` of transformers'; greedy tokens equal
transformers' under batching, chunked prefill, preemption and prefix reuse. The kernel is
also checked row by row against a masked reference at head_dim 64 (the AVX-512 fast path,
windows longer and shorter than its 512-token partitions) and 32/256 (the generic path).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.model_config import ModelConfig
from kvstack.model.arch.decoder import LlamaModel
from kvstack.model.arch.ops import select_ops
from kvstack.model.arch.window import check_window_support, prefill_window_mask
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.loader.registry import load_model
from kvstack.testing.families import (
    hf_greedy,
    paged_logits,
    tiny_family_config,
    transformers_model,
    write_transformers_folder,
)
from kvstack.testing.tiny_models import random_llama_weights, write_gguf

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 2e-3
TIE_GAP = 1e-4
W = 8
BS = 4
NEW_TOKENS = 12


@dataclass
class Tiny:
    config: ModelConfig
    hf: Any
    folder: Path
    gguf: Path | None


CASES = {
    "mistral": {"sliding_window": W},
    "qwen2": {"sliding_window": W, "window_layers": (False, True)},
}


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    cfg = tiny_family_config(request.param, **CASES[request.param])
    weights = random_llama_weights(cfg, seed=11)
    hf = transformers_model(cfg, weights)
    tmp = tmp_path_factory.mktemp(f"sw-{request.param}")
    folder = write_transformers_folder(tmp / "hf", hf, cfg.vocab_size)
    gguf = write_gguf(tmp / "m.gguf", cfg, weights) if cfg.window_layers is None else None
    return Tiny(cfg, hf, folder, gguf)


def test_the_window_is_read_per_layer(tiny: Tiny) -> None:
    for path in (tiny.folder, tiny.gguf):
        if path is None:
            continue
        cfg = load_model(str(path)).config
        want = [None, W] if tiny.config.window_layers else [W, W]
        assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == want, path.name
        assert cfg.has_window


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_logits_match_transformers(tiny: Tiny, kernels: bool) -> None:
    built = load_kernels() if kernels else None
    assert built is not None or not kernels, "the C++ kernels failed to build"
    loaded = load_model(str(tiny.folder))
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, ops=select_ops(built))
    ids = torch.randint(0, 320, (29,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny.hf(ids[None]).logits[0]
    # Whole; chunks shorter than the window; one longer; then decode steps past it.
    plans = ([29], [5, 3, 6, 7], [13, 10], [20])
    diff = max((paged_logits(model, ids, c, kernels) - ref).abs().max().item() for c in plans)
    print(f"{tiny.config.architecture} W={W} kernels={kernels}: max |diff| {diff:.1e}")
    assert diff < LOGIT_ATOL


PROMPT_LENS = [5, 11, 23, 30, 30]  # the last two share a 24-token prefix


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    out[-1][:24] = out[-2][:24]
    return out


@pytest.fixture(scope="module")
def refs(tiny: Tiny, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy(tiny.hf, ids, NEW_TOKENS) for ids in prompts]


def _check(name: str, refs: list[tuple[list[int], list[float]]], outs: list[Any]) -> None:
    for i, ((ref, gaps), out) in enumerate(zip(refs, outs, strict=True)):
        got = list(out.outputs[0].token_ids)
        assert len(got) == NEW_TOKENS, f"{name}: prompt {i} gave {len(got)} tokens"
        for step, (a, b) in enumerate(zip(ref, got, strict=True)):
            if a != b:
                assert gaps[step] < TIE_GAP, (
                    f"{name}: prompt {i} diverges at token {step} ({a} vs {b}); "
                    f"reference top-2 gap {gaps[step]:.2e}"
                )
                break


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_matches_transformers(
    tiny: Tiny, prompts: list[list[int]], refs: list[tuple[list[int], list[float]]]
) -> None:
    """Batched, then on prefix hits; chunked prefill (chunks of 5 < W and 13 > W) — all
    with the hybrid KV manager (the default with a window); preempted (14 blocks for five
    requests) with one table for all layers."""
    llm = LLM(str(tiny.folder), dtype="float32", block_size=BS, num_blocks=64)
    _check("batch", refs, llm.generate(prompt_token_ids=prompts, sampling_params=greedy()))
    again = llm.generate(prompt_token_ids=prompts, sampling_params=greedy())
    assert sum(o.num_cached_tokens for o in again) > 0, "expected prefix-cache hits"
    _check("prefix hits", refs, again)
    for budget in (5, 13):
        chunked = LLM(
            str(tiny.folder), dtype="float32", block_size=BS, num_blocks=64,
            max_num_batched_tokens=budget, max_num_seqs=3,
        )  # fmt: skip
        outs = chunked.generate(prompt_token_ids=prompts, sampling_params=greedy())
        _check(f"chunks of {budget}", refs, outs)
    # One table for all layers (the hybrid manager frees out-of-window blocks instead:
    # tests/model/test_hybrid_engine.py preempts it with a smaller pool).
    small = LLM(
        str(tiny.folder), dtype="float32", block_size=BS, num_blocks=14, max_num_seqs=5,
        disable_hybrid_kv_cache_manager=True,
    )  # fmt: skip
    outs = small.generate(prompt_token_ids=prompts, sampling_params=greedy())
    assert small.engine.scheduler.num_preemptions_total > 0, "expected preemptions"
    _check("preempted", refs, outs)


def test_what_presses_refuse_with_a_window(tiny: Tiny) -> None:
    """A press compresses full-attention layers only: a model whose every layer slides
    (Mistral) has none and is refused (startup: ``ConfigError``; a request:
    ``InvalidRequestError``); with full layers (Qwen2) presses run, once or again while
    decoding."""
    check_window_support(tiny.config, None)  # every codec reads windows
    llm = LLM(str(tiny.folder), dtype="float32", num_blocks=32)
    once = SamplingParams(max_tokens=2, kv_press="snapkv", kv_press_ratio=0.5)
    if tiny.config.window_layers is None:  # Mistral
        with pytest.raises(ConfigError, match=r"every layer of this model.*--kv-press"):
            check_window_support(tiny.config, "snapkv")
        with pytest.raises(ConfigError, match="nothing to press"):
            LLM(str(tiny.folder), dtype="float32", num_blocks=32, kv_press="snapkv")
        with pytest.raises(InvalidRequestError, match="nothing to press"):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=once)
        return
    check_window_support(tiny.config, "snapkv")
    every = SamplingParams(max_tokens=9, kv_press="knorm", kv_press_ratio=0.5, kv_press_every=4)
    for params in (once, every):
        out = llm.generate(prompt_token_ids=[list(range(5, 40))], sampling_params=params)
        assert len(out[0].outputs[0].token_ids) == params.max_tokens
        llm.engine.kv_manager.check_integrity()
    assert llm.engine.stats().num_represses >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 32, 256])
def test_kernel_window_matches_a_masked_reference(head_dim: int, dtype: torch.dtype) -> None:
    """Rows of contexts up to 1,100 tokens (three 512-token partitions), windows shorter
    and longer than a partition, against softmax over the keys ``(p - W, p]``."""
    kernels = load_kernels()
    assert kernels is not None, "the C++ kernels failed to build"
    gen = torch.Generator().manual_seed(head_dim)
    bs, nb, kvh, h = 16, 80, 2, 4
    kc = torch.randn(nb, bs, kvh, head_dim, generator=gen).to(dtype)
    vc = torch.randn(nb, bs, kvh, head_dim, generator=gen).to(dtype)
    table = torch.randperm(nb, generator=gen)[:70]
    lens = torch.tensor([1, 7, 9, 600, 1100])
    q = torch.randn(len(lens), h, head_dim, generator=gen).to(dtype)
    keys = kc[table].flatten(0, 1).float()  # [70 * bs, KVH, d] in logical order
    vals = vc[table].flatten(0, 1).float()
    for window in (1, 8, 700):
        out = kernels.paged_attention(q, kc, vc, table[None], torch.zeros(5).long(), lens,
                                      0.1, window)  # fmt: skip
        for r, n in enumerate(lens.tolist()):
            lo = max(0, n - window)
            k = keys[lo:n].repeat_interleave(h // kvh, 1).transpose(0, 1)  # [H, n', d]
            v = vals[lo:n].repeat_interleave(h // kvh, 1).transpose(0, 1)
            p = torch.softmax(q[r].float()[:, None] @ k.transpose(1, 2) * 0.1, -1)
            want = (p @ v)[:, 0]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(out[r].float(), want, atol=tol), (window, n)


def test_prefill_window_mask() -> None:
    """The docstring's picture: W = 4, queries at positions 5..7 of an 8-key context."""
    got = prefill_window_mask(3, 8, 4).int().tolist()
    assert got == [[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]]
