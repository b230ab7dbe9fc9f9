"""A vLLM client changes nothing: vLLM 0.33's defaults, errors, output fields and
endpoints on a tiny random model, in process (``docs/serving/vllm_compat.md`` lists them)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstack import LLM
from kvstack.core.errors import ConfigError
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.frontend_options import FrontendOptions
from kvstack.serve.server import ServerOptions
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

MAX_LEN = 64
TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    cfg = tiny_llama_config()
    d = write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))
    return LLM(str(d), dtype="float32", num_blocks=64, max_model_len=MAX_LEN)


def app_for(llm: LLM, **kw: Any) -> Any:
    frontend = FrontendOptions(**kw.pop("frontend", {}))
    config = ServerConfig(model_name="tiny", frontend=frontend, identity="tiny-test", **kw)
    return create_app(AsyncEngine(llm.engine), config)


@pytest.fixture(scope="module")
def client(llm: LLM) -> Iterator[TestClient]:
    with TestClient(app_for(llm, model_aliases=("alias",))) as c:
        yield c


def error(r: Any, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["code"] == status, e
    return str(e["message"])


def events(c: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_completions_default_to_16_tokens_and_refuse_past_the_context(
    client: TestClient,
) -> None:
    body: dict[str, Any] = {"prompt": [5, 6, 7], "ignore_eos": True}
    r = client.post("/v1/completions", json=body).json()
    assert r["usage"]["completion_tokens"] == 16
    assert r["system_fingerprint"].startswith("kvstack-")
    r = client.post("/v1/completions", json={**body, "max_tokens": None}).json()
    assert r["usage"]["completion_tokens"] == MAX_LEN - 3  # null: to the context's end
    too_long = {"prompt": list(range(3, 43)), "max_tokens": 100, "ignore_eos": True}
    msg = error(client.post("/v1/completions", json=too_long), 400, "max_tokens")
    assert msg == (  # vLLM's _validate_input
        f"'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum "
        f"context length is {MAX_LEN} tokens and your request has 40 input tokens "
        f"(100 > {MAX_LEN} - 40)."
    )


def test_vllms_error_objects(client: TestClient) -> None:
    long = {"prompt": list(range(3, 3 + MAX_LEN + 5)), "max_tokens": 1}
    msg = error(client.post("/v1/completions", json=long), 400, "input_tokens")
    assert msg.startswith(f"This model's maximum context length is {MAX_LEN} tokens.")
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    e = r.json()["error"]
    assert r.status_code == 404 and e["type"] == "NotFoundError" and e["code"] == 404
    assert e["message"] == "The model `nope` does not exist. Valid aliases: tiny, alias."
    opts = {"prompt": "x", "stream_options": {"include_usage": True}}
    assert "stream=True" in error(client.post("/v1/completions", json=opts), 400, "stream_options")
    beam = {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}
    msg = error(client.post("/v1/chat/completions", json=beam), 400, "use_beam_search")
    assert "beam search" in msg


def test_completion_logprobs_up_to_max_logprobs(client: TestClient, llm: LLM) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    msg = error(client.post("/v1/completions", json={"prompt": "hi", "logprobs": 21}), 400,
                "logprobs")  # fmt: skip
    assert msg == "Requested sample logprobs of 21, which is greater than max allowed: 20"
    with TestClient(app_for(llm, frontend={"max_logprobs": 3})) as c:
        chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                "top_logprobs": 4}  # fmt: skip
        assert "max allowed: 3" in error(c.post("/v1/chat/completions", json=chat), 400,
                                         "logprobs")  # fmt: skip


def test_return_token_ids_and_tokens_as_ids(client: TestClient) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    ch = client.post("/v1/completions", json=body).json()["choices"][0]
    assert ch["prompt_token_ids"] == [5, 6, 7] and len(ch["token_ids"]) == 4
    streamed = [i for e in events(client, "/v1/completions", body) for c in e["choices"]
                for i in c.get("token_ids", [])]  # fmt: skip
    assert streamed == ch["token_ids"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "return_token_ids": True, "logprobs": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    r = client.post("/v1/chat/completions", json=chat).json()
    assert r["prompt_token_ids"] and len(r["choices"][0]["token_ids"]) >= 1
    tokens = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{i}" for i in r["choices"][0]["token_ids"]]
    plain = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0]


def test_request_chat_template_needs_trust(client: TestClient, llm: LLM) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": TEMPLATE, "return_token_ids": True}  # fmt: skip
    msg = error(client.post("/v1/chat/completions", json=body), 400, "chat_template")
    assert "--trust-request-chat-template" in msg
    with TestClient(app_for(llm, frontend={"trust_request_chat_template": True})) as c:
        r = c.post("/v1/chat/completions", json=body).json()
        assert r["prompt_token_ids"] == llm.get_tokenizer().encode(
            "<<hi>>", add_special_tokens=False
        )


def test_default_chat_template_kwargs_under_the_requests_own(llm: LLM) -> None:
    tpl = "{{ tag }}{% for m in messages %}{{ m.content }}{% endfor %}"
    frontend = {"trust_request_chat_template": True, "default_chat_template_kwargs": '{"tag": "Z"}'}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template": tpl, "return_token_ids": True}  # fmt: skip
    enc = llm.get_tokenizer().encode
    with TestClient(app_for(llm, frontend=frontend)) as c:
        r = c.post("/v1/chat/completions", json=body).json()
        assert r["prompt_token_ids"] == enc("Zhi", add_special_tokens=False)
        own = {**body, "chat_template_kwargs": {"tag": "Y"}}
        r = c.post("/v1/chat/completions", json=own).json()
        assert r["prompt_token_ids"] == enc("Yhi", add_special_tokens=False)
    with pytest.raises(ConfigError, match="JSON object"):
        FrontendOptions(default_chat_template_kwargs="[1]")


def test_models_load_tokenize_and_fingerprint(client: TestClient) -> None:
    cards = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == ["tiny", "alias"]
    assert all(m["owned_by"] == "vllm" and m["permission"][0]["object"] == "model_permission"
               for m in cards)  # fmt: skip
    load = client.get("/load").json()
    assert load["server_load"] == 0 and "num_requests_running" in load
    tok = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert len(tok.json()["token_strs"]) == tok.json()["count"]
    chunks = events(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert len({c["system_fingerprint"] for c in chunks}) == 1


def test_invocations_dispatch_by_shape(client: TestClient) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/invocations", json=chat).json()["object"] == "chat.completion"
    comp = {"prompt": "hi", "max_tokens": 2}
    assert client.post("/invocations", json=comp).json()["object"] == "text_completion"
    msg = error(client.post("/invocations", json={"input": "hi"}), 400, None)
    assert "ChatCompletionRequest" in msg and "CompletionRequest" in msg


def test_docs_pages_are_local_and_keyed(client: TestClient, llm: LLM) -> None:
    for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = client.get(page).text
        assert f"/docs-static/{asset}" in html and "cdn" not in html.lower()
        assert client.get(f"/docs-static/{asset}").status_code == 200
    assert client.get("/docs-static/..%2Fcore.py").status_code == 404
    with TestClient(app_for(llm, api_key="k", open_endpoints=frozenset())) as c:
        assert c.get("/docs").status_code == 401 and c.get("/openapi.json").status_code == 401
    with TestClient(app_for(llm, frontend={"disable_fastapi_docs": True})) as c:
        assert c.get("/docs").status_code == 404 and c.get("/openapi.json").status_code == 404


def test_response_role_and_request_log(llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    with TestClient(app_for(llm, frontend={"response_role": "bot",
                                           "enable_log_requests": True})) as c:  # fmt: skip
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        with caplog.at_level(logging.INFO, logger="kvstack.serve"):
            r = c.post("/v1/chat/completions", json=body).json()
        assert r["choices"][0]["message"]["role"] == "bot"
        assert any("Received request chatcmpl-" in x.getMessage() for x in caplog.records)


def test_auto_tool_choice_is_off_by_default_as_in_vllm(llm: LLM) -> None:
    assert ServerOptions().enable_auto_tool_choice is False
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with TestClient(app_for(llm, enable_auto_tool_choice=False)) as c:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
        msg = error(c.post("/v1/chat/completions", json=body), 400, "tool_choice")
        assert msg.startswith('"auto" tool choice requires --enable-auto-tool-choice')


def test_offline_api_names(llm: LLM) -> None:
    from kvstack import SamplingParams, TokensPrompt
    from kvstack.sampling_params import StructuredOutputsParams

    assert StructuredOutputsParams(regex="a+").regex == "a+"
    prompt: TokensPrompt = {"prompt_token_ids": [5, 6, 7]}
    out = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=1))[0]
    tok = llm.get_tokenizer()
    for entry in out.outputs[0].logprobs or []:
        for tid, lp in entry.items():
            assert lp.decoded_token == tok.decode([tid], skip_special_tokens=False)
    assert all(lp.decoded_token is not None for e in out.prompt_logprobs or [] if e
               for lp in e.values())  # fmt: skip
