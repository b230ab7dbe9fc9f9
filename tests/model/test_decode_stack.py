"""``decode_stack`` (``model/arch/decode_stack.py``, ``csrc/decode_stack.cpp``): every layer of
a step in one C++ call gives the Python loop's results bit for bit — the same sampled
tokens and the same logprobs, to the last bit, for bf16 weights (``bf16_linear`` /
``amx_linear``) and int8 / int4 ones (``quant_gemv``), with decodes batched beside short
prefill chunks, n-gram verify rows, a sliding-window model; and it is not taken where it
must not be (float32, an encoded KV cache). Skipped where this CPU has no stack kernel
(``quant_gemv`` needs AVX512-VNNI; the bf16 kernels AMX, AVX512-BF16 or AVX2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstack import LLM, SamplingParams
from kvstack.model.arch.decode_stack import DecodeStack
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.kernels.packed_linear import tile_kernel
from kvstack.model.quant.linear import GEMV
from kvstack.testing.families import tiny_family_config
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

PROMPTS = [[(7 * i + 3 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 30, 17, 50))]
SP = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


def stack_kernel(quantization: str) -> str | None:
    """Why this CPU has no kernel the stack runs for these weights (None: it has one),
    asked of the kernels themselves, not of the stack under test."""
    kernels = load_kernels()
    if kernels is None:
        return "no C++ kernels built"
    if quantization == "none":
        return None if tile_kernel() is not None else "no bf16 tile kernel (AMX/AVX512-BF16/AVX2)"
    ok = GEMV and kernels.quant_gemv_ok(128, 64, 32, 8)  # the tiny model's qkv, int8
    return None if ok else "no quant_gemv (needs AVX512-VNNI)"


def counted(llm: LLM, quantization: str) -> dict[str, int]:
    """Count the steps ``llm``'s stack runs (its ``run`` wrapped). Skipped only where the
    CPU lacks the stack's kernel; where it has one, the stack must exist."""
    missing = stack_kernel(quantization)
    if missing is not None:
        pytest.skip(f"this CPU cannot run decode_stack for {quantization} weights: {missing}")
    stack = llm.engine.runner.model.stack
    assert stack is not None, f"{quantization} weights on a CPU with the kernel: no stack built"
    calls = {"n": 0}
    inner = stack.run

    def run(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        return inner(*a, **kw)

    stack.run = run  # type: ignore[method-assign]
    return calls


def outputs(
    llm: LLM, stacked: bool, prompts: list[list[int]] = PROMPTS, sp: SamplingParams = SP
) -> list[tuple[Any, ...]]:
    model = llm.engine.runner.model
    saved = model.stack
    model.stack = saved if stacked else None
    llm.reset_prefix_cache()
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    finally:
        model.stack = saved
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    return write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_one_call_equals_the_python_loop_bit_for_bit(tiny: Path, quantization: str) -> None:
    llm = LLM(str(tiny), dtype="bfloat16", quantization=quantization, num_blocks=128,
              max_num_batched_tokens=40, block_size=8)  # fmt: skip
    calls = counted(llm, quantization)
    want = outputs(llm, stacked=False)
    assert calls["n"] == 0
    assert outputs(llm, stacked=True) == want
    assert calls["n"] > 20  # decodes, alone and beside short chunks
    llm.engine.check_integrity()


def test_verify_rows_and_windows_take_it_too(tmp_path: Path) -> None:
    cfg = tiny_family_config("mistral", sliding_window=8)
    path = write_hf_folder(tmp_path / "mistral", cfg, random_llama_weights(cfg, seed=4))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    # One block table for all layers (the hybrid manager's groups take the Python loop).
    llm = LLM(str(path), dtype="bfloat16", quantization="int8", num_blocks=128,
              speculative_config=spec, disable_hybrid_kv_cache_manager=True)  # fmt: skip
    calls = counted(llm, "int8")
    repeating = [p[:6] * 4 for p in PROMPTS]  # prompt lookup finds drafts
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # no logprobs
    want = outputs(llm, stacked=False, prompts=repeating, sp=greedy)  # (they never draft)
    assert outputs(llm, stacked=True, prompts=repeating, sp=greedy) == want
    assert calls["n"] > 10
    assert llm.engine.stats().spec_decode["num_drafts"] > 0


def test_not_taken_where_the_python_loop_must_run(tiny: Path) -> None:
    fp32 = LLM(str(tiny), dtype="float32", quantization="int8", num_blocks=64)
    assert fp32.engine.runner.model.stack is None  # quant_linear, not quant_gemv
    llm = LLM(str(tiny), dtype="bfloat16", quantization="int8", num_blocks=64,
              kv_cache_dtype="int8")  # fmt: skip
    calls = counted(llm, "int8")
    llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    assert calls["n"] == 0  # an encoded cache: the Python loop
    dense = LLM(str(tiny), dtype="float32", num_blocks=64)  # F.linear
    assert dense.engine.runner.model.stack is None
    m = dense.engine.runner.model
    assert DecodeStack.build(m.config, m.layers, m.windows, m.dtype, m.ops.name) is None
