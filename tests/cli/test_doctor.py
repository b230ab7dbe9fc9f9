"""``kvstack doctor``: the bug-report facts, with secrets redacted."""

from __future__ import annotations

import json

import pytest
import torch

from kvstack.cli import main
from kvstack.cli.doctor import redact_env
from kvstack.model.kernels import isa


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "bug report" in out and "--kv-cache-memory" in out and "--json" in out


def test_report_names_cpu_kernels_versions_and_pool(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_very_secret_value")
    monkeypatch.setenv("KVSTACK_API_KEY", "sk-also-secret")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    # A CPU without AVX2: --dtype auto gives float32 there, and the pool is sized in it.
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert main(["doctor", "--json", "--kv-cache-memory", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "very_secret" not in out and "also-secret" not in out
    report = json.loads(out)
    model, _ = isa.cpu()
    assert report["cpu"] == (model or "unknown")
    assert report["torch"] == torch.__version__
    assert report["onednn"].startswith("v") or report["onednn"] == "not built in"
    assert report["dtype_auto"] == "float32 (CPU has no AVX2 (no kernels): bf16 would be emulated)"
    assert report["kv_pool"].endswith("float32)")
    assert report["kv_cache_memory"].startswith("0.06 GiB")
    assert "blocks of 16 tokens" in report["kv_pool"]
    active = isa.active()
    loaded = report["kernels_loaded"]
    assert loaded.startswith(active.name) if active else loaded.startswith(("off:", "not"))
    assert report["env"]["HF_TOKEN"] == "<redacted>"
    assert report["env"]["KVSTACK_API_KEY"] == "<redacted>"
    assert report["env"]["OMP_NUM_THREADS"] == "2"


def test_lines_and_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--model", "/nonexistent/model.gguf"]) == 0
    out = capsys.readouterr().out
    lines = dict(ln.split(None, 1) for ln in out.splitlines())
    assert lines["kv_pool"].startswith("unknown (")
    assert "cpu_levels" in lines and "kernels_built" in lines


def test_redaction_keeps_only_relevant_variables() -> None:
    env = {"PATH": "/bin", "KVSTACK_NO_KERNELS": "1", "AWS_SECRET_ACCESS_KEY": "x"}
    assert redact_env(env) == {"KVSTACK_NO_KERNELS": "1"}
