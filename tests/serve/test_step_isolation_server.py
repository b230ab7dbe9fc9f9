"""A request that makes a model step raise ends with a 500 and leaves another client's
stream in the same step untouched (``kvstack/step_isolation.py``). Before, the stream
ended with an error event and ``finish_reason: "error"``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.metrics.server import ServerMetrics
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

BAD = [9, 9, 9, 9]  # the bad request's prompt starts with these ids


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return LLM(str(path), dtype="float32", num_blocks=64, max_model_len=128)


@pytest.fixture
def client(llm: LLM) -> Iterator[TestClient]:
    engine = AsyncEngine(llm.engine, metrics=ServerMetrics("tiny"))
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as c:
        yield c
    eng = llm.engine
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks, "KV blocks leaked"


def internal_errors(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('kvstack:internal_errors_total{where="step"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_bad_request_leaves_another_clients_stream_alone(
    llm: LLM, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"prompt": list(range(20, 30)), "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    eng = llm.engine
    raised: list[int] = []  # rows of each sampling batch that raised
    held = threading.Event()
    sample, step = eng.runner._sample, eng.step
    deadline = time.monotonic() + 60  # never hold the stream longer than this

    def bad_sample(logits: Any, plan: Any, result: Any) -> None:
        if any(r.prompt_token_ids[:4] == BAD for r in plan.sample_reqs):
            raised.append(len(plan.sample_reqs))
            raise RuntimeError("sampling exploded for one row")
        sample(logits, plan, result)

    def gated(final_only: bool = False) -> Any:
        """Hold the stream after 3 tokens until the bad request is queued: one step."""
        running = eng.scheduler.running
        alone = len(eng.scheduler.requests) < 2 and time.monotonic() < deadline
        if alone and running and len(running[0].output_token_ids) >= 3:
            held.set()
            time.sleep(0.005)
            return []
        return step(final_only)

    monkeypatch.setattr(eng.runner, "_sample", bad_sample)
    monkeypatch.setattr(eng, "step", gated)
    lines: list[str] = []

    def stream() -> None:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines.extend(line for line in s.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    assert held.wait(60)
    bad = client.post("/v1/completions", json={"prompt": [*BAD, 40, 41], "max_tokens": 4})
    reader.join(120)
    monkeypatch.undo()

    assert bad.status_code == 500 and "exploded" in bad.json()["error"]["message"]
    assert raised and raised[0] == 2, "the bad request did not share a step with the stream"
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert internal_errors(client) == 1.0
