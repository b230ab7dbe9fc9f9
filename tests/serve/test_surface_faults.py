"""Faults found by reading, not running, the server reproduced here, and the internal
error counter the fuzz relies on: a shard index escaping its folder, unbounded
``/v1/kv_events`` subscribers, a prefill replica that flushed only non-streaming answers,
the Ray ingress without body limit or key on ``/router/state``; a bug stays a 500, is
logged with its traceback and counted in ``kvstack:internal_errors_total``."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from kvstack import LLM
from kvstack.core.errors import ModelLoadError
from kvstack.model.loader.safetensors import load_hf_folder
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.events.stream import KVEventBroadcaster
from kvstack.serve.metrics.server import ServerMetrics
from kvstack.testing.tiny_models import (
    random_llama_weights,
    tiny_llama_config,
    write_gguf,
    write_hf_folder,
)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return path


@pytest.fixture(scope="module")
def llm(gguf: Path) -> LLM:
    return LLM(str(gguf), dtype="float32", num_blocks=64, max_model_len=128)


def served(llm: LLM, **config: Any) -> Iterator[tuple[TestClient, AsyncEngine]]:
    engine = AsyncEngine(llm.engine, metrics=ServerMetrics("tiny"))
    app = create_app(engine, ServerConfig(model_name="tiny", **config))
    with TestClient(app, raise_server_exceptions=False) as client:  # see the 500 itself
        yield client, engine
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    llm.engine.kv_manager.check_integrity()


def internal_errors(client: TestClient, where: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'kvstack:internal_errors_total{{where="{where}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_shard_index_cannot_name_a_file_outside_the_folder(tmp_path: Path, shard: str) -> None:
    cfg = tiny_llama_config()
    root = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg), num_shards=2)
    shard_file = next(root.glob("*.safetensors"))
    (tmp_path / "outside.safetensors").write_bytes(shard_file.read_bytes())
    index = root / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="not a file name"):
        load_hf_folder(root)


def test_kv_event_subscribers_are_capped(llm: LLM) -> None:
    engine = AsyncEngine(llm.engine)
    events = KVEventBroadcaster(engine, max_connections=2)
    first, second = events.open_stream(), events.open_stream()
    assert first is not None and second is not None and events.open_stream() is None
    del first  # dropped before it started (a client that left): the slot comes back
    gc.collect()
    third = events.open_stream()
    assert third is not None and events.open_stream() is None


def test_a_streaming_prefill_answer_waits_for_the_tiers(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    flushed: list[float] = []
    for client, engine in served(llm, role="prefill"):

        async def flush(timeout_s: float) -> bool:
            flushed.append(timeout_s)
            return True

        monkeypatch.setattr(engine, "flush_offload", flush)
        body = {"prompt": "hello there", "max_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(flushed) == 1
        assert client.post("/v1/completions", json={**body, "stream": False}).status_code == 200
        assert len(flushed) == 2


def test_an_unexpected_exception_is_a_counted_logged_500(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*a: Any, **kw: Any) -> list[int]:
        raise RuntimeError("tokenizer bug")

    for client, _ in served(llm):
        monkeypatch.setattr(llm.engine.tokenizer, "encode", broken)
        with caplog.at_level(logging.ERROR, logger="kvstack.serve"):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        monkeypatch.undo()
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        assert any(rec.exc_info for rec in caplog.records)  # the traceback is in the log
        assert internal_errors(client, "http") == 1.0


def test_a_failed_step_is_counted(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = llm.engine.runner
    execute = runner.execute
    calls = [0]

    def fail_once(out: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("kernel bug")
        return execute(out)

    for client, _ in served(llm):
        monkeypatch.setattr(runner, "execute", fail_once)
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "kernel bug" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).is_success
        assert internal_errors(client, "step") == 1.0 and internal_errors(client, "http") == 0


def test_ray_ingress_limits_the_body_and_guards_router_state(gguf: Path) -> None:
    from kvstack.route.ray.ingress import Ingress, IngressLimits

    class Handle:
        def options(self, **kw: Any) -> Handle:
            return self

    ingress = Ingress(Handle(), str(gguf), IngressLimits("k", max_body_bytes=64))

    def call(path: str, body: bytes, headers: dict[str, str]) -> Any:
        sent = [False]

        async def receive() -> dict[str, Any]:
            if sent[0]:
                await asyncio.sleep(3600)
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {
            "type": "http", "method": "POST" if body else "GET", "path": path,
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            "query_string": b"",
        }  # fmt: skip
        return asyncio.run(ingress(Request(scope, receive)))

    assert call("/router/state", b"", {}).status_code == 401
    assert call("/router/state", b"", {"authorization": "Bearer k"}).status_code == 200
    big = json.dumps({"prompt": "x" * 200}).encode()
    assert call("/v1/completions", big, {"content-type": "application/json"}).status_code == 413
