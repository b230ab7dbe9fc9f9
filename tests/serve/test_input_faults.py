"""Faults on the server's input side, each reproduced in process on a tiny random model:
a client-triggerable 500, tokenizing on the event loop and the open ops endpoints, slow
readers, NaN / Infinity, fan-out."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstack import LLM, SamplingParams
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.output_stream import RequestInfo
from kvstack.serve.server import ServerOptions
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return LLM(str(path), dtype="float32", num_blocks=256, max_model_len=256)


def served(llm: LLM, **config: Any) -> Iterator[tuple[TestClient, AsyncEngine]]:
    engine = AsyncEngine(llm.engine)
    with TestClient(create_app(engine, ServerConfig(model_name="tiny", **config))) as client:
        yield client, engine
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    llm.engine.kv_manager.check_integrity()


@pytest.fixture
def client(llm: LLM) -> Iterator[TestClient]:
    for c, _ in served(llm):
        yield c


def error_of(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return dict(err)


# ----------------------------------------------------------------- a client-triggerable 500
@pytest.mark.parametrize("name", ["source", "self", "tokenize", "messages", "chat_template"])
def test_template_kwargs_naming_a_render_parameter_is_400(client: TestClient, name: str) -> None:
    """Was 500 ``render_chat_template() got multiple values for argument 'source'``."""
    body = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {name: "x"}}
    err = error_of(client.post("/v1/chat/completions", json=body))
    assert name in err["message"] and err["param"] == "chat_template_kwargs"
    tok = client.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {name: 1}})
    assert name in error_of(tok)["message"]
    ok = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert client.post("/v1/chat/completions", json=ok).status_code == 200


def test_offline_template_kwargs_clash_is_invalid_request(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="source"):
        llm.engine.tokenizer.apply_chat_template(HI, source="{{ 1 }}")


# ----------------------------------------------------------------- NaN / Infinity
@pytest.mark.parametrize(
    "raw",
    [
        '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
        '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}',
        '{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}',
        '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": NaN}}',
    ],
)
def test_nan_and_infinity_are_400(client: TestClient, raw: str) -> None:
    """Were 200 with garbage tokens: Python's JSON parser accepts them, range checks pass."""
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert "finite" in error_of(r)["message"]


@pytest.mark.parametrize(
    "field", ["temperature", "repetition_penalty", "presence_penalty", "min_p", "top_p"]
)
def test_sampling_params_refuse_non_finite(field: str) -> None:
    for value in (float("nan"), float("inf")):
        with pytest.raises(InvalidRequestError, match="finite"):
            SamplingParams(**{field: value}).validate()


# ----------------------------------------------------------------- fan-out
def test_prompts_times_n_is_capped(llm: LLM) -> None:
    """32 token-id prompts x n=16 queued 512 sequences from one request."""
    for client, _ in served(llm):
        body = {"prompt": [[5, 6, 7]] * 32, "n": 16, "max_tokens": 1}
        err = error_of(client.post("/v1/completions", json=body))
        assert err["param"] == "n" and "512" in err["message"]
    for client, _ in served(llm, max_sequences_per_request=4):
        ok = {"prompt": [[5, 6], [7, 8]], "n": 2, "max_tokens": 1}
        assert len(client.post("/v1/completions", json=ok).json()["choices"]) == 4
        over = {"prompt": [[5, 6], [7, 8], [9, 9]], "n": 2, "max_tokens": 1}
        assert "6 sequences" in error_of(client.post("/v1/completions", json=over))["message"]
        chat = {"messages": HI, "n": 5, "max_tokens": 1}
        error_of(client.post("/v1/chat/completions", json=chat))
    with pytest.raises(ConfigError, match="max-sequences-per-request"):
        ServerOptions(max_sequences_per_request=0)


# ----------------------------------------------------------------- CPU work on the event loop
def test_tokenizing_runs_off_the_event_loop(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2 MB /tokenize ran on the asyncio thread and stalled /health for 1.6 s."""
    tok = llm.engine.tokenizer
    threads: list[str] = []
    encode = tok.encode

    def recording(*a: Any, **kw: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(*a, **kw)

    monkeypatch.setattr(tok, "encode", recording)
    for client, _ in served(llm):
        assert client.post("/tokenize", json={"prompt": "hello"}).status_code == 200
        assert client.post("/tokenize", json={"messages": HI}).status_code == 200
        body = {"prompt": "hello", "max_tokens": 1}
        assert client.post("/v1/completions", json=body).status_code == 200
        chat = {"messages": HI, "max_tokens": 1}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert len(threads) == 4 and all(t.startswith("kvstack-tokenize") for t in threads), threads


def test_ops_endpoints_need_the_key_as_configured(llm: LLM) -> None:
    key = {"Authorization": "Bearer k"}
    for client, _ in served(llm, api_key="k"):
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            assert error_of(client.post(path, json=body), 401)["code"] == "invalid_api_key"
            assert client.post(path, json=body, headers=key).status_code == 200
        assert client.get("/load").status_code == 401
        assert client.get("/load", headers=key).json()["served_model_name"] == "tiny"
        assert client.get("/metrics").status_code == 200  # as vLLM: Prometheus scrapes
        assert "/v1/completions" in client.get("/openapi.json").json()["paths"]
        assert client.get("/health").status_code == 200
    for client, _ in served(llm, api_key="k", open_endpoints=frozenset()):
        assert client.get("/metrics").status_code == 401
        assert client.get("/openapi.json").status_code == 401
        assert client.get("/openapi.json", headers=key).status_code == 200
        assert client.get("/version").status_code == 200
    with pytest.raises(ConfigError, match="unknown"):
        ServerOptions(open_endpoints="metrics,v1")


# ----------------------------------------------------------------- slow readers
def test_a_slow_reader_holds_one_output_not_one_per_step(llm: LLM) -> None:
    """Every step's cumulative output was queued: 400 tokens x n=16 with logprobs unread
    held 1.28 M token ids for a result of 6,400."""
    engine = AsyncEngine(llm.engine)
    engine.start()
    params = SamplingParams(n=4, max_tokens=40, ignore_eos=True, logprobs=5, temperature=0.0)

    async def unread_then_read() -> list[Any]:
        stream = await engine.add("slow", [5, 6, 7, 8], params, RequestInfo("completions"))
        deadline = time.monotonic() + 120
        while engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the engine finishes it while nobody reads
        assert engine.num_active == 0, "the request did not finish"
        return [out async for out in stream]

    try:
        outs = asyncio.run(unread_then_read())
    finally:
        asyncio.run(engine.shutdown(0))
    assert len(outs) == 1 and outs[0].finished
    assert [len(c.token_ids) for c in outs[0].outputs] == [40] * 4
    assert all(len(c.logprobs or []) == 40 for c in outs[0].outputs)
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
