"""``--quantization`` through the engine on tiny written models: ``gguf`` keeps Q4_1 / Q8_0 /
Q4_K / Q5_0 packed and, in float32, generates the tokens of the dequantized model (logprobs
within 1e-4) under another weights fingerprint; a type without a packed kernel falls back
with one warning naming it; int8 / int4 quantize an HF folder at load; bad choices fail
at startup."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest

from kvstack import LLM, SamplingParams
from kvstack.cli import build_parser
from kvstack.core.errors import ConfigError
from kvstack.model.kernels import loader as kernels_mod
from kvstack.model.loader.fingerprint import model_fingerprint
from kvstack.model.loader.registry import default_model_path
from kvstack.model.quant.linear import QuantLinear
from kvstack.testing.tiny_models import (
    random_llama_weights,
    tiny_llama_config,
    write_gguf,
    write_hf_folder,
)

PROMPTS = ["Hello world", "The KV cache stores keys and values", "1 2 3 4 5 6 7 8 9"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def tiny_gguf(tmp: Path, dtype: str, width: int = 64) -> Path:
    cfg = tiny_llama_config(
        vocab_size=49152,
        hidden_size=width,
        intermediate_size=2 * width,
        head_dim=width // 4,
        tie_word_embeddings=True,
    )
    weights = random_llama_weights(cfg, seed=7)
    return write_gguf(
        tmp / f"tiny-{dtype}.gguf",
        cfg,
        weights,
        tokenizer_from=default_model_path(),
        dtype=dtype,
        embedding_dtype="Q8_0",
    )


def generate(path: Path, **kw: object) -> tuple[LLM, list[list[int]], list[float]]:
    llm = LLM(str(path), num_blocks=32, block_size=8, **kw)  # type: ignore[arg-type]
    outs = llm.generate(PROMPTS, GREEDY, check_integrity=True)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [
        lp[t].logprob
        for o in outs
        for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True)
    ]
    return llm, tokens, lps


@pytest.mark.parametrize(("qtype", "width"), [("Q4_1", 64), ("Q4_K", 256), ("Q5_0", 64)])
def test_gguf_packed_generates_as_the_dequantized_model_in_fp32(
    tmp_path: Path, qtype: str, width: int
) -> None:
    path = tiny_gguf(tmp_path, qtype, width)
    dense, want, want_lp = generate(path, dtype="float32")
    llm, got, got_lp = generate(path, dtype="float32", quantization="gguf")
    # tiers never mix KV of dense and packed weights
    assert model_fingerprint(llm.engine.model) != model_fingerprint(dense.engine.model)
    model = llm.engine.model
    layers = [model.lm_head] + [
        getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")
    ]
    assert all(isinstance(lin, QuantLinear) and lin.kernel == "quant_linear" for lin in layers)
    assert {lin.packed.source for lin in layers if isinstance(lin, QuantLinear)} == {qtype, "Q8_0"}
    assert got == want
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) < 1e-4


def test_gguf_packed_runs_in_bf16(tmp_path: Path) -> None:
    _, tokens, _ = generate(tiny_gguf(tmp_path, "Q4_0"), quantization="gguf")
    assert all(len(t) == 12 for t in tokens)


def test_type_without_packed_kernel_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kernels_mod, "_fallbacks", Counter())
    path = tiny_gguf(tmp_path, "Q5_1")
    _, want, _ = generate(path, dtype="float32")
    with caplog.at_level(logging.WARNING, logger="kvstack.kernels"):
        llm, got, _ = generate(path, dtype="float32", quantization="gguf")
    warned = [r.getMessage() for r in caplog.records if "Q5_1" in r.getMessage()]
    assert len(warned) == 1 and "GGUF type Q5_1 has no packed kernel" in warned[0]
    counts = kernels_mod.fallback_counts()
    assert counts[("quant_linear", "gguf_Q5_1")] == 2 * 7  # 2 layers x 7 matrices
    assert isinstance(llm.engine.model.lm_head, QuantLinear)  # the Q8_0 embedding still packs
    assert not isinstance(llm.engine.model.layers[0].qkv, QuantLinear)
    assert got == want


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int8_and_int4_quantize_an_hf_folder_at_load(tmp_path: Path, scheme: str) -> None:
    cfg = tiny_llama_config(vocab_size=49152)
    folder = write_hf_folder(
        tmp_path / "hf", cfg, random_llama_weights(cfg, seed=3), tokenizer_from=default_model_path()
    )
    _, want, _ = generate(folder, dtype="float32")
    llm, got, _ = generate(folder, dtype="float32", quantization=scheme)
    assert isinstance(llm.engine.model.layers[1].down, QuantLinear)
    assert llm.engine.model.layers[1].down.packed.source == scheme
    assert all(len(t) == 12 for t in got)
    if scheme == "int8":  # random weights have near-ties; int4's noise flips them
        assert sum(a[0] == b[0] for a, b in zip(got, want, strict=True)) >= 2


def test_bad_quantization_choices_fail_at_startup(tmp_path: Path) -> None:
    cfg = tiny_llama_config(vocab_size=49152)
    folder = write_hf_folder(
        tmp_path / "hf", cfg, random_llama_weights(cfg), tokenizer_from=default_model_path()
    )
    with pytest.raises(ConfigError, match="--quantization gguf keeps a GGUF file's"):
        LLM(str(folder), quantization="gguf")
    with pytest.raises(ConfigError, match="unknown quantization 'awq'"):
        LLM(str(folder), quantization="awq")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "awq", "hi"])
    args = build_parser().parse_args(["generate", "--quantization", "int4", "hi"])
    assert args.quantization == "int4"
