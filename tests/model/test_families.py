"""Qwen2, Qwen3 and Mistral against transformers: tiny random models saved by transformers
(``save_pretrained``) and written as GGUF, loaded by kvstack, fp32.

Logits of a prompt run whole, then chunked with a decode step on a shuffled block table
(PyTorch ops and C++ kernels), are within ``LOGIT_ATOL`` of transformers'; greedy tokens
equal transformers' greedy loop in one batch, with chunked prefill, under preemption and
on prefix-cache hits. A divergence is accepted only where the reference's top-2 gap is a
numerical tie (``TIE_GAP``), as in ``test_parity.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.core.model_config import ModelConfig
from kvstack.model.arch.decoder import LlamaModel
from kvstack.model.arch.ops import select_ops
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.loader.gguf import GGUFFile
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

LOGIT_ATOL = 2e-3  # fp32; observed ~1e-5
TIE_GAP = 1e-4
NEW_TOKENS = 10
FAMILIES = ["qwen2", "qwen3", "mistral"]


@dataclass
class Tiny:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    hf: Any  # transformers' model
    folder: Path  # saved by transformers
    gguf: Path  # written by kvstack's tiny_models (llama.cpp's layout)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    cfg = tiny_family_config(request.param)
    weights = random_llama_weights(cfg, seed=5)
    hf = transformers_model(cfg, weights)
    tmp = tmp_path_factory.mktemp(request.param)
    folder = write_transformers_folder(tmp / "hf", hf, cfg.vocab_size)
    return Tiny(cfg, weights, hf, folder, write_gguf(tmp / "m.gguf", cfg, weights))


def test_both_formats_load_the_family_and_its_weights(tiny: Tiny) -> None:
    for path in (tiny.folder, tiny.gguf):
        loaded = load_model(str(path))
        cfg = loaded.config
        assert cfg.architecture == tiny.config.architecture
        assert (cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == (
            tiny.config.qkv_bias,
            tiny.config.qk_norm,
            tiny.config.head_dim,
        )
        assert (cfg.rope_theta, cfg.rms_norm_eps) == (
            tiny.config.rope_theta,
            tiny.config.rms_norm_eps,
        )
        assert loaded.weights.keys() == tiny.weights.keys()
        for name, w in tiny.weights.items():
            assert torch.equal(loaded.weights[name], w), f"{path.name}: {name}"
    if tiny.config.architecture == "mistral":
        assert load_model(str(tiny.folder)).config.sliding_window == 512


def test_gguf_qk_rows_are_permuted_only_for_llama_layouts(tiny: Tiny) -> None:
    """llama.cpp's converter permutes q/k for its LLAMA arch (mistral is written as llama),
    never for qwen2/qwen3 (``Qwen2Model.modify_tensors`` maps names only)."""
    q = tiny.weights["model.layers.0.self_attn.q_proj.weight"]
    with GGUFFile.open(tiny.gguf) as g:
        stored = g.tensor("blk.0.attn_q.weight")
        names = set(g.tensors)
    permuted = tiny.config.architecture == "mistral"
    assert torch.equal(stored, q) != permuted
    if tiny.config.qkv_bias:
        assert {"blk.1.attn_q.bias", "blk.1.attn_k.bias", "blk.1.attn_v.bias"} <= names
        assert "blk.1.attn_output.bias" not in names
    if tiny.config.qk_norm:
        assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_logits_match_transformers(tiny: Tiny, fmt: str, kernels: bool) -> None:
    loaded = load_model(str(tiny.folder if fmt == "hf" else tiny.gguf))
    built = load_kernels() if kernels else None
    assert built is not None or not kernels, "the C++ kernels failed to build"
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, ops=select_ops(built))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tiny.config.vocab_size, (21,), generator=gen)
    with torch.no_grad():
        ref = tiny.hf(ids[None]).logits[0]
    # Whole; then 13 tokens, 7 more attending to the cached 13, and one decode step.
    diff = max(
        (paged_logits(model, ids, c, kernels) - ref).abs().max().item() for c in ([21], [13, 7])
    )
    print(f"{tiny.config.architecture} {fmt} {select_ops(built).name}: max |diff| {diff:.1e}")
    assert diff < LOGIT_ATOL


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_bfloat16_logits_are_as_close_as_transformers_own(tiny: Tiny, kernels: bool) -> None:
    """In bf16 kvstack is no further from transformers' fp32 logits than transformers'
    own bf16 run is (observed: 0.05-0.06 against 0.06-0.12)."""
    built = load_kernels() if kernels else None
    model = LlamaModel(tiny.config, tiny.weights, torch.bfloat16, ops=select_ops(built))
    ids = torch.randint(
        0, tiny.config.vocab_size, (21,), generator=torch.Generator().manual_seed(1)
    )
    bf16 = transformers_model(tiny.config, tiny.weights).to(torch.bfloat16)
    with torch.no_grad():
        ref = tiny.hf(ids[None]).logits[0]
        own = (bf16(ids[None]).logits[0].float() - ref).abs().max().item()
    diff = (paged_logits(model, ids, [13, 7], kernels).float() - ref).abs().max().item()
    print(f"{tiny.config.architecture} bf16: max |diff| {diff:.3f} (transformers bf16: {own:.3f})")
    assert diff < 1.5 * own + 0.01


PROMPT_LENS = [5, 11, 23, 30, 30]  # the last two share a 24-token prefix


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    out[-1][:24] = out[-2][:24]
    return out


def _check(name: str, refs: list[tuple[list[int], list[float]]], outs: list[Any]) -> None:
    for i, ((ref, gaps), out) in enumerate(zip(refs, outs, strict=True)):
        got = list(out.outputs[0].token_ids)
        assert len(got) == NEW_TOKENS, f"{name}: prompt {i} gave {len(got)} tokens"
        for step, (a, b) in enumerate(zip(ref, got, strict=True)):
            if a != b:
                assert gaps[step] < TIE_GAP, (
                    f"{name}: prompt {i} diverges from transformers at token {step} "
                    f"({a} vs {b}); reference top-2 gap {gaps[step]:.2e}"
                )
                break


@pytest.fixture(scope="module")
def refs(tiny: Tiny, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy(tiny.hf, ids, NEW_TOKENS) for ids in prompts]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_greedy_matches_transformers_batched_and_on_prefix_hits(
    tiny: Tiny, prompts: list[list[int]], refs: list[tuple[list[int], list[float]]]
) -> None:
    llm = LLM(str(tiny.folder), dtype="float32", block_size=4, num_blocks=64)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(), check_integrity=True)
    _check("batch", refs, outs)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(), check_integrity=True)
    assert sum(o.num_cached_tokens for o in again) > 0, "expected prefix-cache hits"
    _check("prefix hits", refs, again)


def test_greedy_matches_transformers_chunked_and_preempted(
    tiny: Tiny, prompts: list[list[int]], refs: list[tuple[list[int], list[float]]]
) -> None:
    llm = LLM(
        str(tiny.folder),
        dtype="float32",
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=7,
        max_num_seqs=3,
    )
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(), check_integrity=True)
    _check("chunked", refs, outs)
    small = LLM(str(tiny.gguf), dtype="float32", block_size=4, num_blocks=14, max_num_seqs=5)
    outs = small.generate(prompt_token_ids=prompts, sampling_params=greedy(), check_integrity=True)
    assert small.engine.scheduler.num_preemptions_total > 0, "expected preemptions"
    _check("preempted", refs, outs)


@pytest.mark.parametrize(("arch", "head_dim"), [("qwen2", 16), ("qwen3", 128), ("mistral", 16)])
def test_transformers_reads_the_ggufs_kvstack_writes(
    tmp_path: Path, arch: str, head_dim: int
) -> None:
    """transformers' own GGUF reader (which un-permutes q/k for llama only) gives logits
    identical to the original model: the written layout is llama.cpp's. Its qwen3 reader
    ignores ``qwen3.attention.key_length`` (head_dim 128 then, its default); a Mistral
    GGUF is written as llama.cpp writes one, ``general.architecture = "llama"``, and
    kvstack reads it as the llama family with the same weights."""
    cfg = tiny_family_config(arch, head_dim=head_dim)
    weights = random_llama_weights(cfg, seed=2)
    hf = transformers_model(cfg, weights)
    gguf_arch = "llama" if arch == "mistral" else arch
    write_gguf(tmp_path / "m.gguf", cfg, weights, architecture=gguf_arch)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, hf(ids).logits, atol=1e-5)
    loaded = load_model(str(tmp_path / "m.gguf"))
    assert loaded.config.architecture == gguf_arch
    assert all(torch.equal(loaded.weights[n], w) for n, w in weights.items())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_gguf_weights_keep_the_unpermuted_rows(
    tmp_path: Path, arch: str, prompts: list[list[int]]
) -> None:
    """``--quantization gguf`` keeps a Q8_0 GGUF's q/k rows as written (no un-permutation
    for these families): its tokens and logprobs are those of the dequantized model."""
    cfg = tiny_family_config(arch)
    path = write_gguf(tmp_path / "q8.gguf", cfg, random_llama_weights(cfg, seed=4), dtype="Q8_0")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    runs = []
    for quantization in ("none", "gguf"):
        llm = LLM(
            str(path), dtype="float32", num_blocks=64, block_size=4, quantization=quantization
        )
        outs = llm.generate(prompt_token_ids=prompts[:3], sampling_params=sp)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    for (want, want_lp), (got, got_lp) in zip(*runs, strict=True):
        assert got == want
        assert want_lp is not None and got_lp is not None
        for t, a, b in zip(got, want_lp, got_lp, strict=True):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
