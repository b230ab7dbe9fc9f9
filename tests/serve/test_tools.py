"""Tools and structured outputs through the server, in process on a tiny random model.

A random model calls tools only when made to: forced ``tool_choice`` values are enforced
by the grammar (so their calls validate against the tool's schema), and the ``auto``
parser is driven by constraining the output to a call's text with ``guided_choice``.
The default model, the official ``openai`` client and LangChain are in
``test_agents_real.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from kvstack import LLM
from kvstack.core.structured_outputs import MAX_SPEC_BYTES
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.api.http_errors import VLLM_ERROR_TYPES
from kvstack.serve.async_engine import AsyncEngine
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS = '{"city": "Paris", "unit": "c"}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    cfg = tiny_llama_config(max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg, seed=5))
    opts = {"num_blocks": 256, "max_model_len": 4096, "max_num_batched_tokens": 4096}
    return LLM(str(path), dtype="float32", **opts)


@pytest.fixture(scope="module")
def engine(llm: LLM) -> AsyncEngine:
    return AsyncEngine(llm.engine)


@pytest.fixture(scope="module")
def client(engine: AsyncEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as c:
        yield c


def chat(client: TestClient, **body: Any) -> Any:
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 120, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream_chat(client: TestClient, **body: Any) -> tuple[str, list[dict[str, Any]], str]:
    """(content, assembled tool calls, finish_reason) of a streamed chat completion."""
    payload = {"messages": ASK, "max_tokens": 120, "stream": True, **body}
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    content, calls, finish = "", {}, ""
    for chunk in map(json.loads, lines[:-1]):
        for ch in chunk["choices"]:
            delta = ch["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                entry = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.get("id") or entry["id"]
                entry["name"] += tc.get("function", {}).get("name") or ""
                entry["arguments"] += tc.get("function", {}).get("arguments") or ""
            finish = ch["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _nest(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def valid_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        fn = call.get("function", call)
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
        assert str(call["id"]).startswith("call_")


def test_required_and_named_tool_choice(client: TestClient, llm: LLM) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        c = chat(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == ""  # vLLM
        valid_calls(c["message"]["tool_calls"])
        assert len(c["message"]["tool_calls"]) == 1
        if choice == named:
            assert c["message"]["tool_calls"][0]["function"]["name"] == "get_time"
        content, calls, finish = stream_chat(
            client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False
        )
        assert finish == "tool_calls" and content == "" and len(calls) == 1
        valid_calls(calls)
    llm.engine.check_integrity()


def test_forced_calls_cut_by_max_tokens_leave_no_raw_call_text(client: TestClient) -> None:
    # vLLM: a forced choice answers content "" and only complete calls; a call cut by
    # max_tokens is neither a call nor "<tool_call>..." text in content.
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        c = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=3)
        assert c["finish_reason"] == "length" and c["message"]["content"] == "", c
        assert not c["message"].get("tool_calls")
        content, calls, finish = stream_chat(client, tools=TOOLS, tool_choice=choice, max_tokens=3)
        assert finish == "length" and content == "" and calls == []


def test_auto_parses_calls_and_keeps_bad_ones_as_content(client: TestClient) -> None:
    c = chat(client, tools=TOOLS, guided_choice=[CALL])
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    valid_calls(c["message"]["tool_calls"])
    content, calls, finish = stream_chat(client, tools=TOOLS, guided_choice=[CALL])
    assert finish == "tool_calls" and content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    bad = "<tool_call>\n{not json\n</tool_call>"
    c = chat(client, tools=TOOLS, guided_choice=[bad])
    assert c["finish_reason"] == "stop" and c["message"]["content"] == bad
    assert "tool_calls" not in c["message"]
    assert stream_chat(client, tools=TOOLS, guided_choice=[bad]) == (bad, [], "stop")
    c = chat(client, tools=TOOLS, tool_choice="none", guided_choice=[CALL])
    assert c["finish_reason"] == "stop" and c["message"]["content"] == CALL


def test_tool_history_and_tools_reach_the_prompt(
    client: TestClient, engine: AsyncEngine, llm: LLM
) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
    ]  # fmt: skip
    seen: list[list[int]] = []
    real = engine.add

    async def spy(rid: str, ids: list[int], *a: Any, **kw: Any) -> Any:
        seen.append(list(ids))
        return await real(rid, ids, *a, **kw)

    engine.add = spy  # type: ignore[method-assign]
    try:
        c = chat(client, messages=history, tools=TOOLS, max_tokens=4)
    finally:
        engine.add = real  # type: ignore[method-assign]
    assert c["finish_reason"] in ("length", "stop")
    prompt = llm.engine.tokenizer.decode(seen[-1], skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert "<tool_response>\n18 C, cloudy\n</tool_response>" in prompt


def test_response_formats_and_guided_fields(client: TestClient) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
    compact = {"guided_whitespace_pattern": " ?"}  # a random model pads flexible whitespace
    so = {"json": schema, "disable_any_whitespace": True}
    for body in ({"response_format": rf, **compact}, {"guided_json": schema, **compact},
                 {"structured_outputs": so}):  # fmt: skip
        c = chat(client, **body)
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
    r = client.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 8,
                                             "guided_choice": ["yes", "no"], "n": 3,
                                             "temperature": 1.0, "seed": 1})  # fmt: skip
    assert r.status_code == 200 and {ch["text"] for ch in r.json()["choices"]} <= {"yes", "no"}
    body = {"prompt": "Code:", "max_tokens": 8, "structured_outputs": {"regex": "[A-F]{4}"}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 4


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"tools": TOOLS + TOOLS[:1]}, 400, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         400, "tool_choice"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
          "tool_choice": "required"}, 400, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, 400, "tool_choice"),
        ({"guided_regex": "(unclosed"}, 400, "guided_regex"),
        ({"guided_json": "{bad"}, 400, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         400, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
         400, "response_format.json_schema.schema"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_regex, guided_choice"),
        ({"guided_regex": "a" * (MAX_SPEC_BYTES + 1)}, 413, "guided_regex"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400,
         "tools.0.function.name"),
        ({"guided_regex": "\ud800"}, 400, "guided_regex"),
        ({"guided_json": '{"a":' + "[" * 3000 + "]" * 3000 + "}"}, 400, "guided_json"),
        ({"guided_json": {"type": "array", "items": {"type": "array", "items": {}}} | {
            "$comment": "x"} | {"items": _nest(200)}}, 400, "guided_json"),
    ],
)  # fmt: skip
def test_bad_input_gets_an_openai_error_and_loses_nothing(
    client: TestClient, llm: LLM, body: dict[str, Any], status: int, param: str
) -> None:
    payload = json.dumps({"messages": ASK, "max_tokens": 4, **body})  # ASCII: \ud800 escaped
    r = client.post("/v1/chat/completions", content=payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    kind = VLLM_ERROR_TYPES.get(status, "invalid_request_error")
    assert err["param"] == param and err["type"] == kind, err
    assert chat(client, max_tokens=2)["finish_reason"] in ("length", "stop")
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng.structured.num_requests == 0
    assert eng.num_free_blocks == eng.kv_manager.num_blocks


def test_tokenize_documents_and_tool_history_render_like_chat(
    client: TestClient, engine: AsyncEngine, llm: LLM
) -> None:
    seen: list[list[int]] = []
    real = engine.add

    async def spy(rid: str, ids: list[int], *a: Any, **kw: Any) -> Any:
        seen.append(list(ids))
        return await real(rid, ids, *a, **kw)

    docs = [{"title": "Hours", "text": "Open 10 to 18."}, {"text": "Tickets cost 5 EUR."}]
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "12:00"},
    ]  # fmt: skip
    engine.add = spy  # type: ignore[method-assign]
    try:
        chat(client, tools=TOOLS, max_tokens=1)
        chat(client, documents=docs, max_tokens=1)
        chat(client, messages=history, max_tokens=1)  # tools left out of a later turn
    finally:
        engine.add = real  # type: ignore[method-assign]
    tok = client.post("/tokenize", json={"messages": ASK, "tools": TOOLS})
    assert tok.status_code == 200 and tok.json()["tokens"] == seen[0]
    decode = llm.engine.tokenizer.decode
    with_docs = decode(seen[1], skip_special_tokens=False)
    assert (
        '# Documents\n\n<document index="1" title="Hours">\nOpen 10 to 18.\n</document>'
        in with_docs
    )
    assert '<document index="2">\nTickets cost 5 EUR.\n</document>' in with_docs
    later = decode(seen[2], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in later
    assert "<tool_response>\n12:00\n</tool_response>" in later and "<tools>" not in later
    r = client.post("/v1/chat/completions", json={"messages": ASK, "documents": [{}] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_tool_schemas_with_defs_and_lenient_history(client: TestClient, llm: LLM) -> None:
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}},
        "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}}}  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
        c = chat(client, tools=[unit, TOOLS[1]], tool_choice=choice, parallel_tool_calls=False)
        calls = c["message"]["tool_calls"]
        assert c["finish_reason"] == "tool_calls" and len(calls) == 1
        if calls[0]["function"]["name"] == "set_unit":
            assert json.loads(calls[0]["function"]["arguments"])["unit"] in ("c", "f")
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"Unit": {"enum": ["k"]}}, "properties": {}}}}  # fmt: skip
    r = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [unit, other],
                                                  "tool_choice": "required"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "c1", "type": "function",
         "function": {"name": "get_time", "arguments": "[" * 3000 + "]" * 3000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}]  # fmt: skip
    r = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["kvstack-ignored-fields"] == "messages.1.tool_calls.0.index"


def test_stop_token_text_is_left_out_as_in_vllm(client: TestClient, llm: LLM) -> None:
    z = llm.engine.tokenizer.encode("z", add_special_tokens=False)
    assert len(z) == 1
    body = {"prompt": "Say:", "max_tokens": 8, "guided_regex": "xyz", "stop_token_ids": z}
    for extra, want in (({}, "xy"), ({"include_stop_str_in_output": True}, "xyz")):
        r = client.post("/v1/completions", json={**body, **extra})
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
            want,
            "stop",
            z[0],
        )
    eos = sorted(llm.engine.tokenizer.eos_token_ids)[0]
    forced_eos = {"prompt": "Say:", "max_tokens": 4, "logit_bias": {str(eos): 100},
                  "skip_special_tokens": False}  # fmt: skip
    choice = client.post("/v1/completions", json=forced_eos).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    # Tool requests keep special tokens in the text the parser reads (vLLM), and the EOS
    # that ends the output is still left out of it.
    c = chat(client, tools=TOOLS, guided_choice=[CALL], max_tokens=120)
    assert c["finish_reason"] == "tool_calls"
