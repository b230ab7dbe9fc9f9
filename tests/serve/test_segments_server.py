"""Segment reuse through the server, in process on a tiny random model: each tool,
each document and each content part marked ``kvstack_segment`` is reused in any order,
reported in ``usage.prompt_tokens_details.kvstack_segment_tokens`` and ``/metrics``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstack.config.engine import EngineConfig
from kvstack.kv.events import SegmentStored
from kvstack.route.policy.base import RouteRequest
from kvstack.route.policy.kv_index import BlockHasher, EventIndex
from kvstack.route.policy.prompt import prompt_info
from kvstack.route.policy.vllm_index import RequestHashes
from kvstack.serve.server import ServerOptions, build_server
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf


def tool(name: str, words: int) -> dict[str, Any]:
    props = {f"arg_{name}_{i}": {"type": "string", "description": f"field {i} of {name}"}
             for i in range(words)}  # fmt: skip
    return {"type": "function", "function": {"name": name, "description": f"The {name} tool",
            "parameters": {"type": "object", "properties": props}}}  # fmt: skip


TOOLS = [tool("alpha", 3), tool("beta", 4), tool("gamma", 2)]
ASK = [{"role": "user", "content": "Use a tool."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    cfg = tiny_llama_config(max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg, seed=3))
    engine = EngineConfig.from_options(
        model=str(path), dtype="float32", num_blocks=256, max_model_len=2048
    )
    llm, _, app, _ = build_server(
        engine, ServerOptions(served_model_name="t", enable_auto_tool_choice=True)
    )
    SERVED["llm"] = llm
    with TestClient(app) as c:
        yield c
    llm.engine.check_integrity()


SERVED: dict[str, Any] = {}


def chat(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"model": "t", "max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


def segment_tokens(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"].get("kvstack_segment_tokens", 0))


def metric(client: TestClient, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_tools_in_any_order_reuse_their_segments(client: TestClient) -> None:
    first = chat(client, messages=ASK, tools=TOOLS)
    assert segment_tokens(first) == 0  # computed standalone for this request
    again = chat(client, messages=ASK, tools=[TOOLS[2], TOOLS[0], TOOLS[1]])
    assert segment_tokens(again) > 0.5 * again["usage"]["prompt_tokens"]
    subset = chat(client, messages=ASK, tools=[TOOLS[1]])
    assert 0 < segment_tokens(subset) < segment_tokens(again)
    assert metric(client, "kvstack:segment_cache_hits_total") >= segment_tokens(again)
    assert metric(client, "kvstack:segment_cache_queries_total") > metric(
        client, "kvstack:segment_cache_hits_total"
    )
    assert metric(client, "kvstack:segment_recomputed_tokens_total") > 0


def test_reused_tokens_never_exceed_the_prompt(client: TestClient) -> None:
    """A segment the prefix cache already covers is counted once, as a cached token: the
    segment count is the tokens copied from segment entries, past the prefix hit."""
    tools = [tool("zeta", 5), tool("eta", 4)]
    for order in (tools, tools, tools[::-1], tools[::-1], tools):
        body = chat(client, messages=ASK, tools=order)
        usage = body["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached + segment_tokens(body) <= usage["prompt_tokens"], usage
    assert cached > 0  # the same order again: a prefix hit


def test_documents_and_marked_parts(client: TestClient) -> None:
    docs = [
        {"title": f"d{i}", "text": f"Document {i} says " + "words " * (20 + i)} for i in range(3)
    ]
    chat(client, messages=ASK, documents=docs)
    body = chat(client, messages=ASK, documents=docs[::-1])
    assert segment_tokens(body) > 0
    part = {"type": "text", "text": "A long shared passage. " * 12, "kvstack_segment": True}
    for lead in ("First question.", "Another, longer question here."):
        msg = [{"role": "user", "content": [{"type": "text", "text": lead}, part]}]
        body = chat(client, messages=msg)
    assert segment_tokens(body) > 0


def test_bad_segment_field_is_a_400(client: TestClient) -> None:
    part = {"type": "text", "text": "x", "kvstack_segment": "yes"}
    r = client.post(
        "/v1/chat/completions",
        json={"model": "t", "messages": [{"role": "user", "content": [part]}]},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_a_pressed_request_keeps_its_tools_unsegmented(client: TestClient) -> None:
    """Tools become segments on their own; a press drops KV a copy would fill, so a
    request with one is served as before (never a 400 for something it did not ask)."""
    body = chat(client, messages=ASK, tools=TOOLS, kv_press="knorm", kv_press_ratio=0.3)
    assert segment_tokens(body) == 0


def test_segment_entries_are_kv_events_the_router_can_match(client: TestClient) -> None:
    """A ready entry is announced (``SegmentStored``, kvstack's SSE stream and snapshot) under
    the key the router computes from the same request body with the replica's ``/load``
    parameters and tokenizer; the router's index then credits the segments to the replica."""
    llm = SERVED["llm"]
    got: list[Any] = []
    llm.engine.kv_events.subscribe(got.append)
    fresh = [tool("delta", 5), tool("epsilon", 2)]  # no earlier test computed these
    body = {"model": "t", "messages": ASK, "tools": fresh, "max_tokens": 2}
    info = prompt_info(llm.tokenizer, "/v1/chat/completions", json.dumps(body).encode())
    assert info is not None and len(info.segments) == 2
    load = client.get("/load").json()
    req = RouteRequest(info.token_ids, info.cache_salt, info.segments, info.sink)
    keys = RequestHashes(req, BlockHasher(load["block_size"], load["model_id"]), "sha256")
    chat(client, **body)
    announced = {e.segment_key for e in got if isinstance(e, SegmentStored)}
    held = set(llm.engine.held_segment_keys())
    assert set(keys.segment_keys()) <= announced <= held
    index = EventIndex()
    snapshot = [{"type": "SegmentSnapshot", "segment_keys": [k.hex() for k in held]}]
    index.apply("r", {"seq": 0, "ts": 0.0, "snapshot": True, "events": snapshot})
    assert index.segments_held("r", keys.segment_keys()) == [True, True]
    index.check_integrity()
