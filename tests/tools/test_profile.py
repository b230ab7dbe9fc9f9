"""``kvstack profile`` on a tiny random model (JSON, PNG, table), its bad-input exits, and
``kvstack plan --profile`` reading the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstack.cli import main
from kvstack.model.loader.registry import default_model_path
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config(vocab_size=49152, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    return write_gguf(path, cfg, random_llama_weights(cfg, seed=2), default_model_path())


@pytest.fixture(scope="module")
def profile_json(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile")
    rc = main([
        "profile", "--model", str(tiny), "--batch", "3", "--context", "40", "--steps", "3",
        "--kv-cache-dtype", "int8", "--json", str(out / "p.json"), "--png", str(out / "p.png"),
        "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    return out / "p.json"


def test_profile_writes_json_png_and_table(
    profile_json: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(profile_json.read_text())
    assert data["schema"] == "kvstack-profile/1" and data["kv_cache_dtype"] == "int8"
    assert profile_json.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    pre, dec = data["phases"]["prefill"], data["phases"]["decode"]
    assert pre["tokens"] == 3 * 40 and dec["tokens"] == 3 * 3 and dec["steps"] == 3
    names = {r["name"] for r in dec["ops"]}
    assert {"qkv", "o", "gate_up", "down", "lm_head", "attention", "norm", "other"} <= names
    attn = next(r for r in dec["ops"] if r["name"] == "attention")
    # 2 layers x 3 decode steps of 3 rows; a row attends its whole context (4 heads x 16
    # dims, 4 FLOPs per pair): contexts 43, 44, 45 (prompt 40, first token, 2 warm-up steps)
    assert attn["calls"] == 2 * 3 and dec["context_lens"] == [45, 45, 45]
    assert attn["flops"] == 2 * 4 * 4 * 16 * 3 * (43 + 44 + 45)
    assert all(r["bound"] in ("memory", "compute", "overhead") for r in dec["ops"])
    assert data["bounds"]["bandwidth_gb_s"] > 0 and data["bounds"]["peak_gflop_s"] > 0


def test_plan_reads_the_profile(profile_json: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--profile", str(profile_json), "--rate", "2", "--prompt-tokens", "500",
            "--output-tokens", "100"]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| prefill | 1,000 |" in text and "| decode | 200 |" in text
    assert "not modelled:" in text
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    prefill, decode = plan["phases"]
    assert prefill["tokens_per_s"] == 1000 and decode["tokens_per_s"] == 200
    assert prefill["needs"] in ("compute", "memory bandwidth", "host overhead")
    assert main(["plan", "--profile", str(profile_json)]) == 2


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--model", "/no/such/model.gguf"], "not found"),
        (["--context", "300"], "exceeds the model's context 256"),
        # checked before the KV cache is sized for it (which would fail to allocate)
        (["--context", str(2**40)], "exceeds the model's context 256"),
        (["--batch", str(2**36)], "cannot allocate the KV cache"),
        (["--batch", "4", "--kv-cache-memory", "32KiB"], "KV blocks, the KV budget holds"),
    ],
)
def test_profile_bad_input_is_one_line_and_exit_2(
    tiny: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["profile", "--model", str(tiny), "--context", "40", "--no-progress", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("kvstack: error:") and message in err[0]


def test_profile_of_quantized_weights_counts_their_packed_bytes(
    tiny: Path, profile_json: Path, tmp_path: Path
) -> None:
    """``--quantization int4``: each linear's bytes are its packed bytes (0.375x bf16's for
    4-bit groups of 32 with a float32 scale and min, 0.3125x in quant_gemv's tiles with
    fp16 ones, plus the same activations)."""
    out = tmp_path / "q.json"
    rc = main([
        "profile", "--model", str(tiny), "--batch", "3", "--context", "40", "--steps", "3",
        "--kv-cache-dtype", "int8", "--quantization", "int4", "--json", str(out),
        "--png", str(tmp_path / "q.png"), "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    quant, dense = json.loads(out.read_text()), json.loads(profile_json.read_text())
    assert quant["quantization"] == "int4" and "quantization" in dense

    def weight_bytes(doc: dict[str, object], name: str) -> float:
        ops = doc["phases"]["decode"]["ops"]  # type: ignore[index]
        return next(r["bytes"] for r in ops if r["name"] == name)  # type: ignore[no-any-return]

    for name in ("qkv", "gate_up", "down"):
        ratio = weight_bytes(quant, name) / weight_bytes(dense, name)
        assert 0.3125 < ratio < 0.5, (name, ratio)


def test_profile_times_each_op_where_decode_steps_run_in_one_call(
    tiny: Path, tmp_path: Path
) -> None:
    """An unencoded bf16 cache: decode steps would run ``decode_stack`` (one C++ call for
    every layer) where this CPU has its kernels; the profile still times each linear."""
    out = tmp_path / "auto.json"
    rc = main([
        "profile", "--model", str(tiny), "--batch", "3", "--context", "40", "--steps", "3",
        "--json", str(out), "--png", str(tmp_path / "auto.png"), "--no-progress",
    ])  # fmt: skip
    assert rc == 0
    ops = {r["name"]: r for r in json.loads(out.read_text())["phases"]["decode"]["ops"]}
    for name in ("qkv", "o", "gate_up", "down", "attention"):
        assert ops[name]["calls"] == 2 * 3, (name, ops[name])
