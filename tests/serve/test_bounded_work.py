"""Bounded work before rendering, on a tiny random model in process: segment location
is linear and many-part bodies are refused before templating, large bodies are parsed
off the event loop (``/health`` keeps answering), a stalled reader of a multi-prompt
stream holds a bounded number of outputs, and a shutdown during a step frees every
block of the requests it aborts."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstack import LLM
from kvstack.core.request import SamplingParams
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.api.openai_api import ApiContext, OpenAIHandler
from kvstack.serve.api.protocol import (
    MAX_MESSAGES,
    CompletionRequest,
    DetokenizeRequest,
)
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.chat.messages import MAX_CONTENT_PARTS
from kvstack.serve.chat.segments import MAX_MARKED_PARTS, locate_segments
from kvstack.serve.output_stream import OutputStream, RequestInfo
from kvstack.serve.server import check_kv_at_exit
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

HEALTH_BOUND_S = 2.0  # generous: /health answers in milliseconds when the loop is free


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return LLM(str(path), dtype="float32", num_blocks=256, max_model_len=256)


@pytest.fixture
def client(llm: LLM) -> Iterator[TestClient]:
    engine = AsyncEngine(llm.engine)
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as c:
        yield c
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks


def param_of(r: Any) -> str | None:
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


# --------------------------------------------------------------- segment location
class CountingStr(str):
    """A text that counts the characters its ``find`` calls scan."""

    scanned = 0

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        at = super().find(sub, start, end)
        lo = 0 if start is None else start
        hi = (len(self) if end is None else end) if at < 0 else at + len(sub)
        CountingStr.scanned += max(0, hi - lo)  # up to the match, or the whole window
        return at


@pytest.mark.parametrize("same", [True, False])
def test_segment_location_scans_the_text_a_bounded_number_of_times(same: bool) -> None:
    """Each candidate's search rescanned every segment found before it: 1,000 identical
    parts were cubic (31 s through the server)."""
    for k in (250, 1000):
        parts = [("x" * 30) if same else f"passage {i:05d} " + "y" * 16 for i in range(k)]
        text = CountingStr("<system>be brief</system><user>" + "\n".join(parts) + "</user>")
        CountingStr.scanned = 0
        found = locate_segments(text, [[p] for p in parts])
        assert [tag for _, _, tag in found] == list(range(k))
        assert all(text[s:e] == parts[t] for s, e, t in found)
        assert CountingStr.scanned <= 2 * len(text), (k, CountingStr.scanned, len(text))


def test_segment_location_finds_segments_rendered_out_of_order() -> None:
    """A template may render tools after the messages: searched before the cursor too."""
    text = "<user>the question</user><tools>TOOL-A TOOL-B</tools><assistant>"
    found = locate_segments(text, [["TOOL-A"], ["TOOL-B"], ["the question"]])
    assert [(text[s:e], t) for s, e, t in found] == [
        ("the question", 2), ("TOOL-A", 0), ("TOOL-B", 1)
    ]  # fmt: skip


def test_many_parts_and_messages_are_refused_before_templating(client: TestClient) -> None:
    part = {"type": "text", "text": "a passage of text", "kvstack_segment": True}
    marked = [{"role": "user", "content": [part] * (MAX_MARKED_PARTS + 1)}]
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json={"messages": marked, "max_tokens": 1})
    took = time.perf_counter() - t0
    assert param_of(r) == "messages" and str(MAX_MARKED_PARTS) in r.json()["error"]["message"]
    print(f"{MAX_MARKED_PARTS + 1} marked parts: 400 in {took:.3f} s")
    plain = {"type": "text", "text": "x"}
    wide = [{"role": "user", "content": [plain] * (MAX_CONTENT_PARTS + 1)}]
    r = client.post("/v1/chat/completions", json={"messages": wide, "max_tokens": 1})
    assert param_of(r) == "messages.0.content"
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    for path in ("/v1/chat/completions", "/tokenize"):
        assert param_of(client.post(path, json={"messages": many, "max_tokens": 1})) == "messages"
    at_cap = [{"role": "user", "content": [{**part, "text": "ok"}] * 8}]
    assert client.post("/tokenize", json={"messages": at_cap}).status_code == 200


# --------------------------------------------------------------- bodies off the loop
def test_large_bodies_are_parsed_off_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 5 MB body was parsed and validated on the event loop (/health stalled 7.8 s).
    The validation here also sleeps 3 s, so on the loop it would hold /health that long."""
    threads: list[str] = []
    validating = threading.Event()
    validate = DetokenizeRequest.model_validate

    def slow(data: Any, **kw: Any) -> DetokenizeRequest:
        threads.append(threading.current_thread().name)
        validating.set()
        time.sleep(3.0)
        return validate(data, **kw)

    monkeypatch.setattr(DetokenizeRequest, "model_validate", slow)
    body = {"tokens": [5] * 1_000_000}  # 3 MB
    result: dict[str, Any] = {}
    poster = threading.Thread(
        target=lambda: result.setdefault("r", client.post("/detokenize", json=body))
    )
    poster.start()
    assert validating.wait(60), "the body never reached validation"
    latencies = []
    while poster.is_alive() and len(latencies) < 20:
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    poster.join(60)
    assert result["r"].status_code == 200 and len(result["r"].json()["prompt"]) > 0
    assert threads and all(t.startswith("kvstack-tokenize") for t in threads), threads
    print(f"/health during a 3 MB /detokenize: max {max(latencies):.3f} s over {len(latencies)}")
    assert latencies and max(latencies) < HEALTH_BOUND_S


# --------------------------------------------------------------- stalled multi-prompt reader
def test_a_stalled_multi_prompt_stream_holds_a_bounded_number_of_outputs(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each prompt's one-slot buffer was drained into an unbounded queue of cumulative
    outputs (4 prompts x n=16, 600 steps: 2,399 items, 356 MiB)."""
    taken: dict[str, int] = {}
    anext = OutputStream.__anext__

    async def counting(self: OutputStream) -> Any:
        out = await anext(self)
        taken[self.request_id] = taken.get(self.request_id, 0) + 1
        return out

    monkeypatch.setattr(OutputStream, "__anext__", counting)
    engine = AsyncEngine(llm.engine)
    engine.start()
    handler = OpenAIHandler(ApiContext(engine, llm.engine.tokenizer, "tiny"))
    req = CompletionRequest.model_validate({
        "prompt": [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]], "n": 4,
        "max_tokens": 60, "ignore_eos": True, "temperature": 1.0, "stream": True,
    })  # fmt: skip

    async def stall_then_read() -> tuple[dict[str, int], list[str]]:
        sp = req.sampling_params(engine.generation_defaults)
        prompts = [(list(p), None, None) for p in req.prompts() if not isinstance(p, str)]
        rid, jobs = await handler.start(prompts, req, sp, "completions", None)
        chunks: AsyncIterator[str] = handler.stream(rid, req, jobs, chat=False)
        first = [await chunks.__anext__()]
        deadline = time.monotonic() + 120
        while engine.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the engine finishes all 16 while nobody reads
        assert engine.num_active == 0, "the requests did not finish"
        stalled = dict(taken)
        return stalled, first + [c async for c in chunks]

    try:
        stalled, chunks = asyncio.run(stall_then_read())
    finally:
        asyncio.run(engine.shutdown(0))
    print(f"outputs taken from each prompt's stream while stalled: {stalled}")
    # Per prompt: the one the reader took, the queued one, the one in its pump's hand.
    assert len(stalled) == 4 and all(n <= 3 for n in stalled.values()), stalled
    assert chunks[-1] == "data: [DONE]\n\n"
    texts: dict[int, int] = {}
    for c in chunks[:-1]:
        for ch in json.loads(c[len("data: ") :])["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], 0) + (ch["finish_reason"] is not None)
    assert sorted(texts) == list(range(16)) and all(v == 1 for v in texts.values())
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks


# --------------------------------------------------------------- shutdown mid-step
def test_shutdown_during_a_step_runs_the_queued_aborts(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM during a generation longer than --shutdown-grace: the aborts were queued,
    the loop stopped after the step in progress, and they never ran (exit status 1, "41 of
    1024 blocks held by requests")."""
    step = llm.engine.step

    def slow_step(*a: Any, **kw: Any) -> Any:
        time.sleep(0.3)  # longer than shutdown's wait between queuing aborts and stopping
        return step(*a, **kw)

    monkeypatch.setattr(llm.engine, "step", slow_step)
    engine = AsyncEngine(llm.engine)
    engine.start()
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def generate_then_stop() -> None:
        stream = await engine.add("long", list(range(5, 60)), params, RequestInfo("completions"))
        await stream.__anext__()  # running, its blocks allocated
        await engine.shutdown(0)

    asyncio.run(generate_then_stop())
    assert not engine.alive
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    assert check_kv_at_exit(llm)
