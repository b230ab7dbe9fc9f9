"""vLLM's command-line spellings on ``kvstack serve`` (the kvstack names stay).

A ``vllm serve`` command line, a ``--config`` YAML file, ``VLLM_API_KEY``, ``--version``,
``/ping``, the served-name aliases and CORS; a port in use fails before the model loads.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvstack.cli import build_parser, main
from kvstack.cli.config_file import expand_config_file
from kvstack.config.engine import EngineConfig
from kvstack.model.kernels.isa import auto_dtype
from kvstack.serve.server import ServerOptions, build_server
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

VLLM_LINE = [
    "serve", "some/model.gguf", "--port", "8001", "--served-model-name", "m", "alias",
    "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--kv-cache-dtype",
    "fp8_e4m3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "1", "--enforce-eager",
    "--trust-remote-code", "--dtype", "auto", "--max-model-len", "512",
    "--allowed-origins", '["https://a.example"]', "--root-path", "/llm",
    "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}',
]  # fmt: skip


def test_a_vllm_serve_command_line_parses_to_kvstacks_options() -> None:
    a = build_parser().parse_args(VLLM_LINE)
    assert a.model_tag == "some/model.gguf"
    e = EngineConfig.from_cli_args(a)
    assert e.cache.prefix_cache == "none" and not e.scheduler.enable_chunked_prefill
    assert e.cache.kv_cache_dtype == "fp8" and e.dtype == auto_dtype().dtype  # --dtype auto
    assert e.cache.kv_cache_memory is not None and e.cache.kv_cache_memory > 0
    s = ServerOptions.from_cli_args(a)
    assert s.served_model_name == ("m", "alias") and s.enable_auto_tool_choice
    assert s.allowed_origins == ("https://a.example",) and s.root_path == "/llm"
    assert s.kv_events_config is not None
    flags = ["--no-enable-prefix-caching", "--enable-prefix-caching", "--prefix-cache", "radix"]
    again = build_parser().parse_args(["serve", *flags])
    assert EngineConfig.from_cli_args(again).cache.prefix_cache == "radix"


def test_errors_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cases = [
        ["serve", "--tensor-parallel-size", "2"],
        ["serve", "--kv-events-config", "{bad"],
        ["serve", "--allowed-origins", "[1]"],
        ["serve", "a.gguf", "--model", "b.gguf"],
        ["serve", "--config", str(tmp_path / "missing.yaml")],
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("kvstack: error: ") and "\n" not in err, (argv, err)
    with pytest.raises(SystemExit) as e:  # an unknown spelling: argparse's usage error
        main(["serve", "--enable-prefix-cachin"])
    assert e.value.code == 2


def test_config_file_keys_are_option_names_and_the_command_line_wins(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "port: 9000\nmax_num_seqs: 4\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\nenforce-eager: true\ntrust-remote-code: false\n"
        "kv-events-config: {enable_kv_cache_events: true, topic: kv}\n"
    )
    p = build_parser()
    argv = expand_config_file(p, ["serve", "--config", str(f), "--port", "9001"])
    a = p.parse_args(argv)
    assert a.port == 9001 and a.max_num_seqs == 4 and a.prefix_cache == "none"
    assert ServerOptions.from_cli_args(a).served_model_name == ("a", "b")
    assert '"topic": "kv"' in a.kv_events_config and a.vllm_enforce_eager
    for text, msg in [
        ("port: [1\n", "not valid YAML"),
        ("- 1\n", "must map option names"),
        ("prot: 1\n", "unknown option 'prot'"),
        ("enforce-eager: 3\n", "is a switch"),
    ]:
        f.write_text(text)
        with pytest.raises(Exception, match=msg):
            expand_config_file(p, ["serve", "--config", str(f)])


def test_vllm_api_key_env_and_version(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVSTACK_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert build_parser().parse_args(["serve"]).api_key == "v"
    monkeypatch.setenv("KVSTACK_API_KEY", "k")  # kvstack's own wins
    assert build_parser().parse_args(["serve"]).api_key == "k"
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("kvstack ")


def test_a_port_in_use_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # A model that does not exist: had it been loaded first, the error would name it.
        assert main(["serve", "/nonexistent/model.gguf", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}" in err and "nonexistent" not in err


def test_ping_aliases_cors_and_kv_events(tmp_path: Path) -> None:
    cfg = tiny_llama_config()
    d = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg))
    engine = EngineConfig.from_options(model=str(d), dtype="float32", num_blocks=32)
    opts = ServerOptions(
        served_model_name=("main", "alias"), allowed_origins=("https://a.example",),
        kv_events_config='{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*"}',
    )  # fmt: skip
    _, _, app, _ = build_server(engine, opts)
    pub = app.state.kv_events_publisher
    assert pub is not None and pub.endpoint.startswith("tcp://127.0.0.1:")
    with TestClient(app) as c:
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["main", "alias"]
        body = {"model": "alias", "prompt": [5, 6, 7], "max_tokens": 2}
        r = c.post("/v1/completions", json=body, headers={"Origin": "https://a.example"})
        assert r.status_code == 200 and r.json()["model"] == "main"
        assert r.headers["access-control-allow-origin"] == "https://a.example"
        other = c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert c.post("/v1/completions", json={**body, "model": "x"}).status_code == 404
        long = {"model": "main", "prompt": list(range(3, 40)), "max_tokens": 1}
        assert c.post("/v1/completions", json=long).status_code == 200
        pub.close()  # sends what is queued: the stored blocks of the long prompt
        assert pub.num_batches >= 1 and pub.num_dropped == 0
        assert "kvstack:kv_events_dropped_total" in c.get("/metrics").text
