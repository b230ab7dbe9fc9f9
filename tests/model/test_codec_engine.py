"""Every KV codec through the whole engine on a tiny random model: the C++ codec attention
gives the greedy tokens of the PyTorch reference path (the same engine with the codec's
kernel view withdrawn) in float32, with chunked prefill (short chunks take the kernel)
and prefix hits; in bfloat16 the two paths round differently, so near-ties may flip
(tests/model/test_codec_kernel.py bounds that difference). A codec the kernel cannot
read falls back with one warning and a count."""

from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path

import pytest

from kvstack import LLM, SamplingParams
from kvstack.kv.codecs import CODECS
from kvstack.model.kernels import loader as kernels_mod
from kvstack.model.loader.registry import default_model_path
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

PREFIX = "The bakery opens at seven and closes at two; rye bread on Tuesdays. "
PROMPTS = [PREFIX + "When do you open?", PREFIX + "Rye on Monday?", "1 2 3 4 5 6 7 8 9 10"]
SP = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64 (every codec takes it; the kernel's AVX-512 path), 2 q heads per KV head."""
    cfg = tiny_llama_config(
        vocab_size=49152, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=256,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny64") / "tiny64.gguf"
    return write_gguf(path, cfg, random_llama_weights(cfg, seed=5), default_model_path())


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTACK_NO_KERNELS", raising=False)


def _generate(path: Path, codec: str, dtype: str) -> list[list[int]]:
    llm = LLM(
        str(path), dtype=dtype, kv_cache_dtype=codec, num_blocks=64, block_size=16,
        max_num_batched_tokens=10, max_num_seqs=4,
    )  # fmt: skip
    first = llm.generate(PROMPTS[:1], SP)  # its blocks are cached: the others hit them
    rest = llm.generate(PROMPTS, SP, check_integrity=True)
    return [list(o.outputs[0].token_ids) for o in first + rest]


@pytest.mark.parametrize("codec", ["int8", "fp8", "fp8_e5m2", "int4", "kivi2", "rotated4", "bf16"])
def test_greedy_tokens_unchanged_by_the_kernel(
    tiny64: Path, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = ("paged_decode_attention", "encoded_cache")
    before = kernels_mod.fallback_counts().get(key, 0)
    fused = _generate(tiny64, codec, "float32")
    assert kernels_mod.fallback_counts().get(key, 0) == before, "the kernel path was not taken"
    monkeypatch.setattr(CODECS.get(codec), "kernel_view", lambda self, layer, group=0: None)
    reference = _generate(tiny64, codec, "float32")
    assert kernels_mod.fallback_counts().get(key, 0) > before, "the reference path was not taken"
    assert fused == reference


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_kivi2_tokens_unchanged_by_chunking_prefix_hits_and_preemption(
    tiny64: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KIVI's rows read their own block at full precision and earlier blocks from codes
    however the tokens were cut into steps: one prefill per prompt in a roomy pool gives
    the greedy tokens of 10-token chunks, prefix hits and recompute after preemption in
    8 blocks. (Before, a row saw its own block quantized iff its step filled it.)"""
    if path == "reference":
        monkeypatch.setattr(CODECS.get("kivi2"), "kernel_view", lambda self, layer, group=0: None)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = {"dtype": "float32", "kv_cache_dtype": "kivi2", "max_num_seqs": 3}
    plain = LLM(str(tiny64), prefix_cache="none", num_blocks=64, **kw)
    tight = LLM(str(tiny64), num_blocks=8, max_num_batched_tokens=10, **kw)
    for seed in (3, 5):
        rng = random.Random(seed)
        prefix = [rng.randrange(100, 40000) for _ in range(rng.randrange(30, 60))]
        ps = [
            prefix + [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 14))]
            for _ in range(3)
        ]
        want = [
            o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=sp)
        ]
        got = tight.generate(prompt_token_ids=ps, sampling_params=sp, check_integrity=True)
        assert [o.outputs[0].token_ids for o in got] == want, f"seed {seed}"
    stats = tight.get_stats()
    assert stats.prefix_hit_tokens > 0 and stats.num_preemptions > 0


def test_a_codec_without_a_kernel_view_warns_once_and_counts(
    tiny64: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kernels_mod, "_fallbacks", Counter())
    monkeypatch.setattr(CODECS.get("int4"), "kernel_view", lambda self, layer, group=0: None)
    with caplog.at_level(logging.WARNING, logger="kvstack.kernels"):
        _generate(tiny64, "int4", "float32")
    warned = [r for r in caplog.records if "paged_decode_attention" in r.getMessage()]
    assert len(warned) == 1 and "encoded_cache" in warned[0].getMessage()
    assert kernels_mod.fallback_counts()[("paged_decode_attention", "encoded_cache")] >= 19
