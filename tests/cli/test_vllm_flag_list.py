"""Every ``vllm serve`` flag of the checked-in list parses on ``kvstack serve`` and has a
meaning there: kvstack's own option, an alias of one, or a policy (ignored / neutral /
mapped / refused) that start-up applies with one log line or one error line."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from kvstack.cli import build_parser, main
from kvstack.cli.config_file import expand_config_file
from kvstack.cli.vllm_flag_policies import KINDS
from kvstack.cli.vllm_flags import (
    DEST_PREFIX,
    VLLM_VERSION,
    apply_vllm_flags,
    given_vllm_flags,
    policy_of,
    vllm_serve_flags,
)
from kvstack.config import vllm_args
from kvstack.config.engine import EngineConfig
from kvstack.core.errors import ConfigError
from kvstack.serve.server import ServerOptions


def _serve_parser() -> argparse.ArgumentParser:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _sample(action: argparse.Action) -> list[str]:
    """A value the flag's own parser takes (its first choice, else a number)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(iter(action.choices)))]
    return ["1"]


def test_the_list_is_vllms_current_serve_flags() -> None:
    flags = vllm_serve_flags()
    assert VLLM_VERSION == "0.33.0" and len(flags) > 300
    spellings = {s for f in flags for s in f.strings}
    for s in ("--uvicorn-log-level", "--disable-log-requests", "--lora-modules", "-q",
              "--kv-transfer-config", "--enable-prompt-tokens-details",
              "--load-format"):  # fmt: skip
        assert s in spellings, s


def test_every_vllm_flag_parses_and_has_a_meaning() -> None:
    parser = build_parser()
    known = _serve_parser()._option_string_actions
    missing, unjudged = [], []
    for flag in vllm_serve_flags():
        if flag.dest == "config":  # expanded before parsing (test below)
            continue
        for s in flag.strings:
            if s not in known:
                missing.append(s)
                continue
            action = known[s]
            a = parser.parse_args(["serve", s, *_sample(action)])
            if action.dest.startswith(DEST_PREFIX):
                policy = policy_of(flag.dest)
                if policy is None or policy.kind not in KINDS:
                    unjudged.append(s)
                assert flag.dest in given_vllm_flags(a), s
    assert not missing and not unjudged, (missing, unjudged)


def test_ignored_flags_log_one_line_refused_ones_fail(caplog: pytest.LogCaptureFixture) -> None:
    a = build_parser().parse_args(
        ["serve", "--enforce-eager", "--disable-log-requests", "--api-server-count", "1",
         "--cudagraph-capture-sizes", "1", "2", "--enable-expert-parallel", "--enable-lora",
         "--kv-transfer-config", '{"kv_connector": "x"}', "--load-format", "safetensors",
         "--no-tokens-only", "-q", "none", "-tp", "1", "--disable-prefix-caching"]
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvstack.serve"):
        apply_vllm_flags(a)
    lines = [r.getMessage() for r in caplog.records]
    for s in ("--api-server-count", "--cudagraph-capture-sizes", "--enable-expert-parallel",
              "--enable-lora", "--kv-transfer-config", "--load-format",
              "--tokens-only"):  # fmt: skip
        assert sum(s in line for line in lines) == 1, (s, lines)
    assert EngineConfig.from_cli_args(a).cache.prefix_cache == "none"
    for argv, word in (
        (["--lora-modules", "sql=/tmp/x"], "LoRA"),
        (["--api-server-count", "2"], "one API server"),
        (["--load-format", "dummy"], "random weights"),
        (["--logits-processors", "a.B"], "imports no code"),
        (["--reasoning-parser-plugin", "x.py"], "plugins"),
        (["--headless"], "headless"),
    ):
        a = build_parser().parse_args(["serve", *argv])
        with pytest.raises(ConfigError, match=word) as e:
            apply_vllm_flags(a)
        assert argv[0] in str(e.value)


def test_mapped_flags_set_kvstacks_options() -> None:
    a = build_parser().parse_args(
        ["serve", "--kv-cache-memory-bytes", "64M", "--max-num-queued-reqs", "7",
         "--shutdown-timeout", "3", "--max-logprobs", "9", "--uvicorn-log-level", "debug",
         "--disable-uvicorn-access-log", "--enable-log-requests", "--disable-log-requests"]
    )  # fmt: skip
    apply_vllm_flags(a)
    e, s = EngineConfig.from_cli_args(a), ServerOptions.from_cli_args(a)
    assert e.cache.kv_cache_memory == 64 * 1024 * 1024
    assert s.max_waiting == 7 and s.shutdown_grace == 3.0
    f = s.frontend
    assert f.max_logprobs == 9 and not f.enable_log_requests
    kw = f.uvicorn_kwargs()
    assert kw["log_level"] == "debug" and kw["access_log"] is False


def test_dtype_half_runs_as_bfloat16_with_a_line(caplog: pytest.LogCaptureFixture) -> None:
    for word in ("half", "float16"):
        a = build_parser().parse_args(["serve", "--dtype", word])
        with caplog.at_level(logging.WARNING, logger="kvstack.serve"):
            apply_vllm_flags(a)
        assert EngineConfig.from_cli_args(a).dtype == "bfloat16"
        assert any(f"--dtype {word}: served in bfloat16" in r.getMessage() for r in caplog.records)


def test_gpu_memory_utilization_is_vllms_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    g = 2**30
    mem = {"MemTotal": 24 * g, "MemAvailable": 15 * g}
    monkeypatch.setattr(vllm_args, "meminfo", lambda name: mem[name])
    monkeypatch.setattr(vllm_args, "process_rss", lambda: g)
    assert vllm_args.kv_share(0.2, g) == int(0.2 * 24 * g) - 2 * g  # weights + RSS inside
    assert vllm_args.kv_share(0.9, g) == int(0.8 * 14 * g)  # capped: the host keeps room
    with pytest.raises(ConfigError, match="no room for the KV cache"):
        vllm_args.kv_share(0.05, g)


def test_the_docs_table_is_the_generated_one() -> None:
    from kvstack.cli.vllm_compat_table import END, START, flag_table

    doc = (Path(__file__).parents[2] / "docs" / "serving" / "vllm_compat.md").read_text(
        encoding="utf-8"
    )
    assert doc.split(START, 1)[1].split(END, 1)[0].strip() == flag_table().strip()
    assert f"vLLM {VLLM_VERSION}" in doc


def test_unknown_flag_suggests_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--uvicorn-log-levl", "info"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean --uvicorn-log-level?" in err and len(err.splitlines()) <= 3


def test_vllms_yaml_config_keys(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        'uvicorn-log-level: "info"\nport: 8123\ndisable-log-requests: true\n'
        "enable-prefix-caching: false\ntensor-parallel-size: 1\nmax_logprobs: 5\n"
        "trust-request-chat-template: true\nenable-lora: false\n"
    )
    argv = expand_config_file(build_parser(), ["serve", "--config", str(f)])
    a = build_parser().parse_args(argv)
    apply_vllm_flags(a)
    s = ServerOptions.from_cli_args(a)
    assert s.port == 8123 and s.frontend.max_logprobs == 5
    assert s.frontend.trust_request_chat_template
    assert EngineConfig.from_cli_args(a).cache.prefix_cache == "none"
