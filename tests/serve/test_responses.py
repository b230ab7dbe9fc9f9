"""``/v1/responses`` through the official ``openai`` client against a server on 127.0.0.1
(a tiny random Qwen3 with a Qwen3-style template, ``--reasoning-parser qwen3``; scripted
answers through the ``structured_outputs`` extension): stateless and stored turns,
``previous_response_id`` with its pinned prefix, streamed events, tools, ``text.format``,
the store's bounds and the 404s in vLLM's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai import NotFoundError, OpenAI
from reasoning_util import tiny_qwen3

from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.conversation_options import ConversationOptions
from kvstack.serve.responses.api import ResponsesHandler
from server_util import serve_uvicorn

THINK = "<think>\nPlan the answer.\n</think>\n\nParis is the capital."
ARGS = '{"city": "Paris"}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]


def script(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"choice": [text]}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ResponsesHandler]]:
    llm = tiny_qwen3(tmp_path_factory.mktemp("q3"))
    conv = ConversationOptions(reasoning_parser="qwen3", responses_max_stored=50)
    app = create_app(AsyncEngine(llm.engine), ServerConfig("tiny", conversation=conv))
    with serve_uvicorn(app) as url:
        yield url, app.state.responses


@pytest.fixture
def client(served: tuple[str, ResponsesHandler]) -> OpenAI:
    return OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def test_stateless_answer_splits_reasoning_from_the_message(client: OpenAI) -> None:
    r = client.responses.create(
        model="tiny",
        input="Capital of France?",
        store=False,
        max_output_tokens=200,
        extra_body=script(THINK),
    )
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == "\nPlan the answer.\n"  # type: ignore[union-attr]
    assert r.output_text == "\n\nParis is the capital."
    u = r.usage
    assert u is not None and u.input_tokens > 0 and u.output_tokens > 0
    assert u.output_tokens_details.reasoning_tokens > 0
    assert u.input_tokens_details.cached_tokens >= 0
    with pytest.raises(NotFoundError):  # store=False: nothing to continue or read
        client.responses.retrieve(r.id)


def test_stream_events_are_numbered_and_spell_the_final_response(client: OpenAI) -> None:
    events = list(
        client.responses.create(
            model="tiny",
            input="Capital?",
            stream=True,
            max_output_tokens=200,
            extra_body=script(THINK),
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("\nPlan the answer.\n", "\n\nParis is the capital.")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage is not None
    assert types.count("response.output_item.added") == types.count("response.output_item.done")
    stored = client.responses.retrieve(final.id)  # store defaults to true
    assert stored.output_text == text


def test_previous_response_id_continues_with_the_prefix_pinned(
    client: OpenAI, served: tuple[str, ResponsesHandler]
) -> None:
    first = client.responses.create(
        model="tiny", input="Capital of France?", max_output_tokens=200, extra_body=script(THINK)
    )
    handler = served[1]
    assert handler.store.get(first.id) is not None
    assert handler.store.get(first.id).pinned  # type: ignore[union-attr]
    second = client.responses.create(
        model="tiny", input="And of Italy?", previous_response_id=first.id, max_output_tokens=10
    )
    assert second.previous_response_id == first.id
    u, u1 = second.usage, first.usage
    assert u is not None and u1 is not None
    # The history came from the store: the prompt is longer than the first turn's.
    assert u.input_tokens > u1.input_tokens
    details = u.input_tokens_details.model_dump()
    assert details["cached_tokens"] >= u1.input_tokens // 16 * 16 > 0
    assert details["kvstack_pinned_tokens"] >= 16
    assert handler.store.get(first.id).pinned == []  # type: ignore[union-attr]
    # Continuing from a streamed turn works the same way.
    events = list(
        client.responses.create(
            model="tiny",
            input="Thanks",
            stream=True,
            previous_response_id=second.id,
            max_output_tokens=5,
        )
    )
    assert events[-1].response.previous_response_id == second.id  # type: ignore[union-attr]


def test_unknown_or_deleted_response_ids_are_vllms_404(
    client: OpenAI, served: tuple[str, ResponsesHandler]
) -> None:
    url = served[0]
    r = httpx.post(f"{url}/v1/responses", json={"input": "x", "previous_response_id": "resp_no"})
    assert r.status_code == 404
    assert r.json() == {
        "error": {
            "message": "Response with id 'resp_no' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": 404,
        }
    }
    done = client.responses.create(model="tiny", input="hi", max_output_tokens=3)
    r = httpx.post(f"{url}/v1/responses/{done.id}/cancel")
    assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]
    deleted = httpx.delete(f"{url}/v1/responses/{done.id}").json()
    assert deleted == {"id": done.id, "object": "response.deleted", "deleted": True}
    for call in (
        lambda: client.responses.retrieve(done.id),
        lambda: client.responses.create(model="tiny", input="x", previous_response_id=done.id),
    ):
        with pytest.raises(NotFoundError):
            call()
    assert httpx.delete(f"{url}/v1/responses/{done.id}").status_code == 404


def test_store_bounds_count_age_and_bytes(
    client: OpenAI, served: tuple[str, ResponsesHandler]
) -> None:
    store = served[1].store
    opts = store.opts
    now = [1000.0]
    store.clock = lambda: now[0]
    try:
        store.opts = ConversationOptions(responses_max_stored=2, responses_ttl=60.0)
        ids = [
            client.responses.create(model="tiny", input=f"q{i}", max_output_tokens=2).id
            for i in range(3)
        ]
        assert store.get(ids[0]) is None and store.get(ids[2]) is not None
        with pytest.raises(NotFoundError):
            client.responses.create(model="tiny", input="x", previous_response_id=ids[0])
        now[0] += 61.0  # past the age bound: expired ids answer 404 like unknown ones
        with pytest.raises(NotFoundError):
            client.responses.retrieve(ids[2])
        store.opts = ConversationOptions(responses_max_bytes=1, responses_ttl=60.0)
        big = client.responses.create(model="tiny", input="q", max_output_tokens=2)
        assert store.get(big.id) is None and store.num_bytes <= 1
    finally:
        store.opts, store.clock = opts, __import__("time").monotonic


def test_tools_and_function_call_outputs(client: OpenAI) -> None:
    r = client.responses.create(
        model="tiny",
        input="Weather in Paris?",
        tools=TOOLS,  # type: ignore[arg-type]
        max_output_tokens=200,
        extra_body=script(CALL),
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    call_id = calls[0].call_id  # type: ignore[union-attr]
    follow = client.responses.create(
        model="tiny",
        previous_response_id=r.id,
        tools=TOOLS,
        max_output_tokens=5,  # type: ignore[arg-type]
        input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny"}],
    )
    assert follow.status in ("completed", "incomplete")
    streamed = list(
        client.responses.create(
            model="tiny",
            input="Weather?",
            tools=TOOLS,  # type: ignore[arg-type]
            stream=True,
            max_output_tokens=200,
            extra_body=script(CALL),
        )
    )
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    final = streamed[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["function_call"]


def test_text_format_json_schema_constrains_the_answer(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="tiny",
        input="A digit as JSON",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0.output"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    served: tuple[str, ResponsesHandler], body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{served[0]}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_keep_reasoning_history_reuses_the_previous_answer(
    client: OpenAI, served: tuple[str, ResponsesHandler]
) -> None:
    """strip (Qwen3's template drops the earlier think block): the next turn reuses the
    previous prompt only; keep: the previous prompt and answer, reasoning included."""
    handler = served[1]
    reused: dict[bool, tuple[int, int, int]] = {}
    try:
        for keep, country in ((False, "Spain"), (True, "Peru")):
            handler.keep = keep
            first = client.responses.create(
                model="tiny",
                input=f"Capital of {country}?",
                max_output_tokens=200,
                extra_body=script(THINK),
            )
            second = client.responses.create(
                model="tiny", input="Sure?", max_output_tokens=2, previous_response_id=first.id
            )
            u1, u2 = first.usage, second.usage
            assert u1 is not None and u2 is not None
            reused[keep] = (
                u1.input_tokens,
                u1.output_tokens,
                u2.input_tokens_details.cached_tokens,
            )
    finally:
        handler.keep = False
    print(f"(prompt 1, output 1, cached in turn 2) strip={reused[False]} keep={reused[True]}")
    p1, o1, cached = reused[False]
    assert p1 - 16 < cached <= p1  # the previous prompt's full blocks, no more
    p1, o1, cached = reused[True]
    assert cached >= (p1 + o1 - 1) // 16 * 16 > p1  # its answer too


def test_a_tool_name_the_chat_path_refuses_is_a_400(served: tuple[str, ResponsesHandler]) -> None:
    body = {"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}
    r = httpx.post(f"{served[0]}/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.name"
    body = {"input": [{"type": "reasoning", "content": 5}]}
    r = httpx.post(f"{served[0]}/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content"
