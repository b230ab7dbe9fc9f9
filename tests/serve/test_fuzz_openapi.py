"""Schemathesis against the server's own ``/openapi.json`` (the fault suite): bounded, on a tiny
random model served by uvicorn on loopback, with no API key (so every body reaches the
validators). No case may get a 5xx: bad input is a 4xx because it is validated, and an
internal error stays a 500 (``http_errors._internal``), so a bug the fuzz reaches fails
here instead of hiding in a catch-all. ``kvstack:internal_errors_total`` must stay 0.

Bounded: at most ``EXAMPLES`` cases per operation (about 300 in all; hypothesis stops
earlier on an operation with few distinct inputs), ``max_model_len`` 64 so no
generation runs long, ``derandomize`` so a run is reproducible. ``/v1/kv_events`` and
``/v1/kv/state`` are left out: they stream until the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.metrics.server import ServerMetrics
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from server_util import free_port

EXAMPLES = 40


class Fuzzed:
    def __init__(self, url: str, engine: AsyncEngine, llm: LLM) -> None:
        self.url, self.engine, self.llm = url, engine, llm
        self.http = httpx.Client(base_url=url, timeout=120)
        self.cases = 0


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    llm = LLM(str(path), dtype="float32", num_blocks=256, max_model_len=64)
    engine = AsyncEngine(llm.engine, metrics=ServerMetrics("tiny"), max_waiting=64)
    app = create_app(engine, ServerConfig(model_name="tiny", request_timeout_s=60))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
        assert thread.is_alive(), "server failed to start"
    f = Fuzzed(f"http://127.0.0.1:{port}", engine, llm)
    yield f
    metrics = f.http.get("/metrics").text
    server.should_exit = True
    thread.join(30)
    assert f.cases >= 200, f"only {f.cases} cases ran"
    assert "kvstack:internal_errors_total" not in metrics or all(
        line.endswith(" 0.0")
        for line in metrics.splitlines()
        if line.startswith("kvstack:internal_errors_total")
    ), metrics
    assert engine.num_active == 0
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    llm.engine.kv_manager.check_integrity()


def strategies(document: dict[str, Any]) -> list[tuple[str, st.SearchStrategy[Any]]]:
    """Each operation's cases: valid ones and (where the schema allows any) invalid ones."""
    streams = ["/v1/kv_events", "/v1/kv/state"]
    schema = schemathesis.openapi.from_dict(document).exclude(path=streams)
    out = []
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [op.as_strategy(GenerationMode.POSITIVE)]
        with contextlib.suppress(Exception):  # an operation with nothing to make invalid
            modes.append(op.as_strategy(GenerationMode.NEGATIVE))
        out.append((op.label, st.one_of(modes)))
    return out


def test_no_input_reaches_a_5xx(fuzzed: Fuzzed) -> None:
    ops = strategies(fuzzed.http.get("/openapi.json").json())
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} <= {
        label for label, _ in ops
    }
    for _label, cases in ops:

        @given(case=cases)
        @settings(
            max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        def run(case: Any) -> None:
            fuzzed.cases += 1
            response = case.call(base_url=fuzzed.url, timeout=120)
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
            )
            if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
                error = response.json()["error"]  # every error is an OpenAI error object
                assert error["message"] and error["type"], error

        run()
