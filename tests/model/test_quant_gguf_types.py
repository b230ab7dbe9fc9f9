"""GGUF types kept packed as exact 8-bit codes (Q5_0 groups of 32, Q6_K groups of 16) on
every kernel, at the best ISA level here and, in fresh interpreters, at the AVX2 and
plain AVX-512 levels (``KVSTACK_ISA``); and the real Qwen2.5-Coder-0.5B Q4_K_M GGUF (Q5_0,
Q8_0, Q4_K, Q6_K tensors, Q5_0 q/k fused with a Q8_0 v) under ``--quantization gguf``:
nothing dequantized, float32 greedy tokens equal to the dequantized model's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import quant_types_util as util
from kvstack import LLM, SamplingParams
from kvstack.model.kernels import isa
from kvstack.model.kernels import loader as kernels_mod
from kvstack.model.kernels.loader import Kernels
from kvstack.model.loader.registry import resolve_model_path
from kvstack.model.quant.linear import QuantLinear, StackedLinear


def test_8bit_gguf_types_on_every_kernel_of_this_level(kernels: Kernels) -> None:
    chose = util.check_level(kernels)
    assert chose == {t: {util.expected_bf16_kernel(kernels)} for t in ("Q5_0", "Q6_K")}


# The levels below AVX512-BF16 this CPU runs, each in a fresh interpreter (KVSTACK_ISA).
LOWER_LEVELS = [x.name for x in isa.runnable(isa.cpu_flags()) if x.name in ("avx2", "avx512")]


@pytest.mark.parametrize("level", LOWER_LEVELS)
def test_8bit_gguf_types_at_a_lower_isa_level(level: str) -> None:
    out = util.run_level(level)
    assert f"level {level}" in out


def test_isa_cap_keeps_the_levels_at_or_below_it() -> None:
    assert isa.capped(["avx2", "avx512", "avx512_bf16"], "avx512") == ["avx2", "avx512"]
    assert isa.capped(["avx2", "avx512"], None) == ["avx2", "avx512"]
    with pytest.raises(KeyError, match="unknown ISA level 'sse'"):
        isa.capped(["avx2"], "sse")


@pytest.fixture(scope="module")
def qwen05() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, assembled from its installed part wheels."""
    return resolve_model_path("qwen2.5-coder-0.5b")


@pytest.mark.slow
def test_real_qwen_gguf_is_packed_whole_and_generates_the_dequantized_tokens(
    qwen05: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels_mod, "_fallbacks", Counter())
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = ["def fibonacci(n):"]
    kw = {"dtype": "float32", "num_blocks": 16, "block_size": 16}
    packed = LLM(str(qwen05), quantization="gguf", **kw)
    got = packed.generate(prompt, greedy)[0].outputs[0].token_ids
    model = packed.engine.model
    linears = [model.lm_head] + [
        getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")
    ]
    assert all(isinstance(lin, QuantLinear | StackedLinear) for lin in linears)
    sources = {lin.packed.source for lin in linears if isinstance(lin, QuantLinear)}
    assert sources == {"Q5_0", "Q5_0+Q8_0", "Q8_0", "Q4_K", "Q6_K"}
    assert not [key for key in kernels_mod.fallback_counts() if key[0] == "quant_linear"]
    del packed, model, linears
    dense = LLM(str(qwen05), **kw)
    assert got == dense.generate(prompt, greedy)[0].outputs[0].token_ids
