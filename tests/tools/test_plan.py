"""Tests of ``kvstack plan`` (kvstack.tools.plan): KV sizing arithmetic, registry, bad input."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.core.errors import ConfigError
from kvstack.tools.plan import (
    GB,
    GiB,
    MiB,
    add_plan_args,
    known_gpus,
    known_models,
    make_plan,
    parse_tokens,
    resolve_gpu,
    resolve_model,
    run_plan,
)


def plan(model: str, gpu: str = "h100-80gb", context: int = 131072, **kw: object):
    return make_plan(resolve_model(model), resolve_gpu(gpu), context, **kw)  # type: ignore[arg-type]


def cli(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_plan_args(p)
    return p.parse_args(list(argv))


def test_parse_tokens() -> None:
    # k = 1,024 tokens: 128k = 128 × 1,024 = 131,072; plain ints pass through
    assert parse_tokens("128k") == 131072
    assert parse_tokens("32K") == 32768
    assert parse_tokens("4096") == 4096
    assert parse_tokens("1m") == 1024**2


def test_mistral_large_2_per_token_and_128k_request() -> None:
    p = plan("mistral-large-2", kv_cache_dtype="bf16")
    # 88 layers × 2 (K,V) × 8 KV heads × 128 head_dim × 2 B = 360,448 B = 0.344 MiB
    assert p.kv_bytes_per_token == 88 * 2 * 8 * 128 * 2 == 360_448
    assert round(p.kv_bytes_per_token / MiB, 3) == 0.344
    # × 131,072 tokens = 47,244,640,256 B = 44.0 GiB = 47.2 GB
    assert p.kv_bytes_per_request == 47_244_640_256
    assert p.kv_bytes_per_request / GiB == 44.0
    assert round(p.kv_bytes_per_request / GB, 1) == 47.2


def test_llama_2_70b_32k_fp16() -> None:
    p = plan("llama-2-70b", context=parse_tokens("32k"), kv_cache_dtype="fp16")
    # 80 × 2 × 8 × 128 × 2 B = 327,680 B/token
    assert p.kv_bytes_per_token == 327_680
    # × 32,768 tokens = 10,737,418,240 B = 10.74 GB = 10.0 GiB
    assert p.kv_bytes_per_request == 10_737_418_240
    assert round(p.kv_bytes_per_request / GB, 2) == 10.74
    assert p.kv_bytes_per_request / GiB == 10.0
    # Llama-2-70B's max_position_embeddings is 4,096: 32K is over it
    assert p.warnings and "4,096" in p.warnings[0]


def test_deepseek_v3_mla() -> None:
    p = plan("deepseek-v3", gpu="h200-141gb", tp=8)
    # MLA caches one latent per token per layer: 61 × (512 + 64) × 2 B = 70,272 B (no K/V pair,
    # no heads); the latent is replicated on every TP rank, so the per-GPU figure is the same
    assert p.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    assert p.kv_bytes_per_token_per_gpu == 70_272
    assert p.kv_bytes_per_request == 70_272 * 131_072
    assert p.kv_heads_per_gpu is None and p.attention.startswith("MLA")
    # checkpoint ships in fp8: 671,026,419,200 params × 1 B / 8 GPUs
    assert p.weights_dtype == "fp8"
    assert p.weights_bytes_per_gpu == 671_026_419_200 // 8


def test_fp8_and_int4_kv_halve_and_quarter() -> None:
    bf16 = plan("llama-3.1-8b", kv_cache_dtype="bf16")
    fp8 = plan("llama-3.1-8b", kv_cache_dtype="fp8")
    int4 = plan("llama-3.1-8b", kv_cache_dtype="int4")
    # 32 × 2 × 8 × 128 × 2 B = 131,072 B; fp8 (1 B) = 65,536 B; int4 (0.5 B) = 32,768 B
    assert bf16.kv_bytes_per_token == 131_072
    assert fp8.kv_bytes_per_token == 65_536
    assert int4.kv_bytes_per_token == 32_768
    # half the bytes per request → at least twice the requests on the same budget
    assert fp8.kv_bytes_per_request * 2 == bf16.kv_bytes_per_request
    assert fp8.max_concurrent_requests >= 2 * bf16.max_concurrent_requests


def test_tp_splits_heads_weights_and_budget() -> None:
    p = plan("mistral-large-2", tp=8)
    # 8 KV heads / tp 8 = 1 head per GPU: 88 × 2 × 1 × 128 × 2 = 45,056 B/token per GPU
    assert p.kv_heads_per_gpu == 1
    assert p.kv_bytes_per_token_per_gpu == 45_056
    assert p.kv_bytes_per_request_per_gpu == 45_056 * 131_072 == 5_905_580_032
    # weights 122,610,069,504 × 2 B / 8 = 30,652,517,376 B per GPU
    assert p.weights_bytes_per_gpu == 30_652_517_376
    # reserve = max(1 GiB, 5% × 85,899,345,920) = 4,294,967,296
    assert p.reserve_bytes_per_gpu == 4_294_967_296
    # budget = 85,899,345,920 × 0.9 − 30,652,517,376 − 4,294,967,296 = 42,361,926,656 per GPU
    assert p.kv_budget_bytes_per_gpu == 42_361_926_656
    assert p.kv_budget_bytes_total == 8 * 42_361_926_656
    # floor(42,361,926,656 / 5,905,580,032) = floor(7.17) = 7
    assert p.max_concurrent_requests == 7
    # threshold 1 − 5,905,580,032 / 42,361,926,656 = 0.8606 (inside [0.5, 0.9])
    assert p.autoscale_kv_usage_threshold == pytest.approx(0.8606, abs=1e-4)
    # tp 16 > 8 KV heads: each GPU keeps one (replicated) head, the per-GPU figure stays
    p16 = plan("mistral-large-2", tp=16)
    assert p16.kv_heads_per_gpu == 1 and p16.kv_bytes_per_token_per_gpu == 45_056
    assert any("replicated" in n for n in p16.notes)


def test_prefix_hit_rate_formula() -> None:
    p0 = plan("mistral-large-2", tp=8)
    p = plan("mistral-large-2", tp=8, prefix_hit_rate=0.6)
    budget, r = p.kv_budget_bytes_per_gpu, p.kv_bytes_per_request_per_gpu
    # shared prefix h·R stored once, (1−h)·R per request:
    # N = floor((B − h·R) / ((1−h)·R)) = floor((42.36e9 − 3.54e9) / 2.36e9) = floor(16.43) = 16
    assert p.effective_concurrent_requests == math.floor((budget - 0.6 * r) / (0.4 * r)) == 16
    # h = 0 reduces to floor(B / R)
    assert p0.effective_concurrent_requests == p0.max_concurrent_requests == 7


def test_sliding_window_caps_window_layers() -> None:
    p = plan("mistral-7b", context=8192)
    # all 32 layers slide with W = 4,096: 32 × min(8,192, 4,096) × (2 × 8 × 128 × 2 B = 4,096 B)
    assert p.kv_bytes_per_request == 32 * 4096 * 4096 == 536_870_912
    assert any("sliding window" in n for n in p.notes)


def test_window_layers_count_what_the_engine_holds(tmp_path: Path) -> None:
    """Whole blocks, and of a window layer the blocks its next row can read: the engine's
    own count (``KVGroups.pages_held``, checked against the hybrid manager's held pages in
    tests/kv/test_hybrid.py). Gemma 3 270M's shapes: 15 of 18 layers slide with W = 512."""
    from kvstack.kv.groups import KVGroups

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    cfg = {**LLAMA_31_8B_CONFIG, "num_hidden_layers": 18, "sliding_window": 512}
    cfg |= {"layer_types": types, "num_params": 1, "num_key_value_heads": 1, "head_dim": 256}
    spec = resolve_model(write(tmp_path, cfg))
    groups = KVGroups.plan([512 if t == "sliding_attention" else None for t in types])
    per_layer_token = 2 * 1 * 256 * 2
    for context, block_size in ((4096, 16), (4097, 16), (4100, 16), (1000, 32), (300, 16)):
        p = make_plan(spec, resolve_gpu("h100-80gb"), context, block_size=block_size)
        pages = groups.pages_held(context, block_size)
        want = pages * groups.layers_per_page * block_size * per_layer_token
        assert p.kv_bytes_per_request == want, (context, block_size)
    # 4,097 tokens: 257 blocks per full layer, 33 (528 tokens, not 512) per window layer
    p = make_plan(spec, resolve_gpu("h100-80gb"), 4097)
    assert p.kv_bytes_per_request == (3 * 257 + 15 * 33) * 16 * per_layer_token
    assert any("hold 528 tokens at this context" in n for n in p.notes)
    with pytest.raises(ConfigError, match="--block-size"):
        make_plan(spec, resolve_gpu("h100-80gb"), 4097, block_size=0)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_models_kvstack_serves_by_name_match_their_weights(name: str) -> None:
    """The planner's registry entry of a model ``kvstack serve --model`` knows by name has
    the shapes, windows and parameter count of the GGUF the engine loads."""
    import math

    from kvstack.model.loader.gguf import expected_shapes, read_gguf_config
    from kvstack.model.loader.registry import resolve_model_path

    cfg = read_gguf_config(resolve_model_path("default" if name == "smollm2-135m" else name))
    spec = resolve_model(name)
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    slides = [w for w in windows if w is not None]
    got = (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads,
           spec.head_dim, spec.sliding_window, spec.num_sliding_layers)  # fmt: skip
    assert got == (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, max(slides) if slides else None, len(slides))  # fmt: skip
    assert spec.num_params == sum(math.prod(s) for s in expected_shapes(cfg).values())


def test_unknown_names_list_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"llama-3\.1-8b") as e:
        resolve_model("gpt-9")
    assert "deepseek-v3" in str(e.value)
    with pytest.raises(ConfigError, match="h100-80gb"):
        resolve_gpu("tpu-v9")
    assert {"a100-40gb", "h200-141gb", "mi300x-192gb"} <= set(known_gpus())
    assert len(known_models()) == 12


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp": 0}, "--tp"),
        ({"gpu_memory_utilization": 0.0}, "utilization"),
        ({"gpu_memory_utilization": 1.5}, "utilization"),
        ({"prefix_hit_rate": 1.0}, "hit-rate"),
        ({"prefix_hit_rate": -0.1}, "hit-rate"),
        ({"kv_cache_dtype": "fp4"}, "kv-cache-dtype"),
        ({"context": 0}, "context"),
    ],
)
def test_bad_values(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan("llama-3.1-8b", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["0", "-5", "abc", "12q"])
def test_bad_context_text(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_tokens(text)


def test_bad_gpu_size() -> None:
    with pytest.raises(ConfigError):
        resolve_gpu("-80GiB")
    assert resolve_gpu("96GiB").memory_bytes == 96 * GiB


LLAMA_31_8B_CONFIG = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def write(tmp_path: Path, cfg: dict[str, object]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_hf_config_json(tmp_path: Path) -> None:
    m = resolve_model(write(tmp_path, LLAMA_31_8B_CONFIG))
    # head_dim defaults to 4096 / 32 = 128; KV as for the registry entry
    assert m.head_dim == 128 and m.params_estimated
    # estimate: 2 × 128,256 × 4,096 (embed + head) + 32 × (attention 41,943,040 + MLP 3 × 4,096 ×
    # 14,336) = 8,029,995,008 vs 8,030,261,248 real (norms left out)
    assert m.num_params == 8_029_995_008
    p = make_plan(m, resolve_gpu("h100-80gb"), 131072)
    assert p.kv_bytes_per_token == 131_072 and any("estimated" in n for n in p.notes)
    # a folder holding config.json works too
    assert resolve_model(str(tmp_path)).num_layers == 32


def test_hf_config_missing_field_is_named(tmp_path: Path) -> None:
    cfg = {k: v for k, v in LLAMA_31_8B_CONFIG.items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        resolve_model(write(tmp_path, cfg))
    cfg = {k: v for k, v in LLAMA_31_8B_CONFIG.items() if k != "vocab_size"}
    with pytest.raises(ConfigError, match="vocab_size"):  # needed only to estimate params
        resolve_model(write(tmp_path, cfg))
    with pytest.raises(ConfigError, match="not found"):
        resolve_model(str(tmp_path / "nope" / "config.json"))


def test_hf_config_mla_and_layer_types(tmp_path: Path) -> None:
    mla = {**LLAMA_31_8B_CONFIG, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_params": 1}
    p = make_plan(resolve_model(write(tmp_path, mla)), resolve_gpu("h100-80gb"), 1024)
    assert p.kv_bytes_per_token == 32 * 576 * 2  # 32 layers × (512 + 64) × 2 B
    # 4 layers, 3 sliding with W = 1,024, 1 full: per-layer-token 2 × 8 × 128 × 2 = 4,096 B
    # per request at 4,096 tokens = 4,096 × (1 × 4,096 + 3 × 1,024) = 29,360,128 B
    types = ["sliding_attention"] * 3 + ["full_attention"]
    swa = {**LLAMA_31_8B_CONFIG, "num_hidden_layers": 4, "sliding_window": 1024}
    swa |= {"layer_types": types, "num_params": 1}
    p = make_plan(resolve_model(write(tmp_path, swa)), resolve_gpu("h100-80gb"), 4096)
    assert p.kv_bytes_per_request == 29_360_128
    assert p.kv_bytes_per_token == 4096  # the one full-attention layer
    # Qwen2-style use_sliding_window: false ignores the window
    off = {**swa, "use_sliding_window": False}
    p = make_plan(resolve_model(write(tmp_path, off)), resolve_gpu("h100-80gb"), 4096)
    assert p.kv_bytes_per_request == 4 * 4096 * 4096


def test_context_over_limit_warns(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(cli("--model", "llama-2-7b", "--gpu", "a100-80gb", "--context", "8k")) == 0
    out, err = capsys.readouterr()
    assert "max_position_embeddings" in err and "OVER THE MODEL'S LIMIT" in out
    assert "requests that fit" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli("--model", "mistral-large-2", "--gpu", "h100-80gb", "--context", "128k")
    args.tp, args.json = 8, True
    assert run_plan(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_request"] == 47_244_640_256
    assert data["max_concurrent_requests"] == 7 and data["tp"] == 8
    assert {"kv_budget_bytes_per_gpu", "autoscale_kv_usage_threshold", "notes"} <= set(data)


def test_weights_that_do_not_fit() -> None:
    p = plan("llama-3.1-405b", gpu="a100-40gb", context=4096)
    assert p.kv_budget_bytes_per_gpu < 0 and p.max_concurrent_requests == 0
    assert p.autoscale_kv_usage_threshold is None and p.warnings


def test_python_m_help() -> None:
    """``python -m kvstack.tools.plan --help``: the package's ``__main__`` runs."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstack.tools.plan", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m kvstack.tools.plan")
    assert "--gpu" in out
