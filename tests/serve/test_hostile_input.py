"""Bad input an attack review of the server turned into 500s or failed engine steps, each
reproduced in process on a tiny random model: every value vLLM accepts works (a top_p
that float32 rounds to 0 keeps the most likely token), every value it refuses is a 400
whose ``param`` names the field, and ``kvstack:internal_errors_total`` stays 0.

Also here: a client that closes mid-body is not an internal error (it was counted in
``internal_errors_total{where="http"}`` with a traceback).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.metrics.server import ServerMetrics
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from server_util import serve_uvicorn

S = "a\ud800b"  # a lone surrogate: json.dumps writes it as the escape \ud800
LONG_INT = "9" * 5000  # past CPython's 4,300-digit int-string limit
HI = [{"role": "user", "content": "hi"}]


def raw(body: dict[str, Any]) -> str:
    """``body`` as JSON text; the string ``"@LONG"`` stands for ``LONG_INT``, ``"@INF"``
    for ``1e999`` (a literal json.dumps cannot write)."""
    return json.dumps(body).replace('"@LONG"', LONG_INT).replace('"@INF"', "1e999")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return LLM(str(path), dtype="float32", num_blocks=256, max_model_len=128)


def internal_errors(metrics_text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith("kvstack:internal_errors_total{")
    )


@pytest.fixture(scope="module")
def client(llm: LLM) -> Iterator[TestClient]:
    engine = AsyncEngine(llm.engine, metrics=ServerMetrics("tiny"))
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as c:
        yield c
        assert internal_errors(c.get("/metrics").text) == 0
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    llm.engine.kv_manager.check_integrity()


def post(client: TestClient, path: str, raw: str) -> httpx.Response:
    return client.post(
        path, content=raw.encode("utf-8"), headers={"content-type": "application/json"}
    )


def param_of(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "BadRequestError", error
    return str(error["param"])


# -------------------------------------------------------- valid values at float32's edges
@pytest.mark.parametrize("top_p", ["1e-320", "1e-46", "5e-324", "1e-45"])
def test_a_top_p_float32_rounds_to_zero_keeps_the_most_likely_token(
    client: TestClient, top_p: str
) -> None:
    """Was 500 ``index -1 is out of bounds`` and a failed step (its batch mates failed)."""
    body = '{"prompt": "hello there", "max_tokens": 6, "ignore_eos": true, %s}'
    greedy = post(client, "/v1/completions", body % '"temperature": 0')
    nucleus = post(client, "/v1/completions", body % f'"temperature": 1, "top_p": {top_p}')
    assert nucleus.status_code == 200, nucleus.text
    assert nucleus.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert internal_errors(client.get("/metrics").text) == 0


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 1e308), ("temperature", 3.5e38), ("repetition_penalty", 1e-320),
     ("repetition_penalty", 1e308), ("min_p", 1e-320), ("top_k", 2**70),
     ("seed", 2**63 - 1), ("seed", -(2**63)), ("min_tokens", 1),
     ("logprobs", 6)],  # vLLM takes logprobs up to --max-logprobs (20)
)  # fmt: skip
def test_extreme_values_vllm_accepts_are_answered(
    client: TestClient, field: str, value: Any
) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "n": 2, "logprobs": 2, field: value}
    r = post(client, "/v1/completions", raw(body))
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] in ("length", "stop") for c in r.json()["choices"])


# ---------------------------------------------------- values vLLM refuses: a 400 naming them
@pytest.mark.parametrize(
    "field, value",
    [("top_p", 0), ("top_p", -1e-320), ("top_p", 1.0000001), ("top_p", 2**70),
     ("temperature", -1e-320), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5),
     ("frequency_penalty", -1e308), ("repetition_penalty", 0), ("max_tokens", 0),
     ("max_tokens", 2**70), ("max_tokens", 10**4300 - 1), ("min_tokens", 2**70),
     ("seed", 2**63), ("n", 2**70), ("logprobs", 21), ("prompt_logprobs", 21),
     ("truncate_prompt_tokens", 2**70), ("stop_token_ids", [2**70]),
     ("logit_bias", {"5": 1e39}), ("logit_bias", {str(2**70): 1}),
     ("allowed_token_ids", [2**70]), ("kv_press_ratio", 0.5), ("max_completion_tokens", 4)],
    ids=lambda v: str(v)[:24],
)  # fmt: skip
def test_out_of_range_values_are_400_naming_the_field(
    client: TestClient, field: str, value: Any
) -> None:
    body = {"prompt": "hi", "max_tokens": 3, field: value}
    assert param_of(post(client, "/v1/completions", raw(body))) == field


# --------------------------------------------- lone surrogates, huge integers: 400 not 500
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": S}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", S]}, "prompt.1"),
        ("/v1/completions", {"prompt": "x", "bad_words": [S]}, "bad_words.0"),
        ("/v1/completions", {"prompt": "x", "cache_salt": S}, "cache_salt"),
        ("/v1/completions", {"prompt": "x", "model": S}, "model"),
        ("/v1/completions", {"prompt": "x", "stop": S}, "stop"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {S: 1}}, "logit_bias.a\\ud800b"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": S}]},
         "messages.0.content"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": S}]}]},
         "messages.0.content.0.text"),
        ("/v1/chat/completions", {"messages": HI, "documents": [{"text": S}]},
         "documents.0.text"),
        ("/v1/chat/completions",
         {"messages": HI, "tools": [{"type": "function", "function": {
             "name": "f", "description": S, "parameters": {"type": "object"}}}]},
         "tools.0.function.description"),
        ("/tokenize", {"prompt": S}, "prompt"),
        ("/v1/cache/pin", {"prompt": S}, "prompt"),
        ("/v1/cache/unpin", {"prompt": "x", "cache_salt": S}, "cache_salt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "@LONG"}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, "@LONG"]}, "prompt.1"),
        ("/detokenize", {"tokens": ["@LONG"]}, "tokens.0"),
        ("/v1/completions", {"prompt": "x", "temperature": "@INF"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": float("nan")}, "top_p"),
        ("/v1/cache/unpin", {"prompt": [2**70] * 20}, "prompt"),
        ("/v1/cache/pin", {"prompt": [-1] * 20}, "prompt"),
    ],
)  # fmt: skip
def test_bad_text_and_numbers_are_400_naming_the_field(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    """Were 500s: ``TextInputSequence must be str`` (tokenizer), ``UnicodeEncodeError``
    (cache_salt, an error message quoting the model), ``Exceeds the limit (4300 digits)``
    (json.loads), ``int too big to convert`` (hashing an unpinned prefix)."""
    r = post(client, path, raw(body))
    assert param_of(r) == param


def test_a_valid_surrogate_pair_is_text(client: TestClient) -> None:
    r = post(client, "/tokenize", raw({"prompt": "\U0001f600 and \\ud800"}))
    assert r.status_code == 200 and r.json()["count"] > 0, r.text


# ------------------------------------------------------- a client leaving mid-body
def test_a_client_closing_mid_body_is_not_an_internal_error(llm: LLM) -> None:
    """Content-Length 1000, 10 bytes, close: was a traceback and
    ``internal_errors_total{where="http"}`` + 1 per connection."""
    metrics = ServerMetrics("tiny")
    app = create_app(AsyncEngine(llm.engine, metrics=metrics), ServerConfig(model_name="tiny"))
    with serve_uvicorn(app) as url:
        host, port = url.removeprefix("http://").split(":")
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/cache/pin"):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    'Content-Length: 1000\r\n\r\n{"prompt":'.encode()
                )
        deadline = time.monotonic() + 30
        text = httpx.get(url + "/metrics").text
        while closed(text) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices each close on its own loop
            text = httpx.get(url + "/metrics").text
        assert closed(text) == 4, text
        assert internal_errors(text) == 0, text
        assert httpx.get(url + "/health").status_code == 200


def closed(metrics_text: str) -> float:
    """The 499s (client closed the request) counted in ``metrics_text``."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith("kvstack:http_errors_total{") and 'status="499"' in line
    )
