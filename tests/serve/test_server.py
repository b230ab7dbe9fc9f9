"""The real server (a `kvstack serve` process on a free loopback port) driven by `openai`.

Bad input and the fuzz are in ``test_server_input.py``, servers with other limits in
``test_server_limits.py``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from keyed_server_util import KEY, keyed_server, metric, wait_idle
from kvstack import LLM, SamplingParams
from server_util import ServerProcess

SYSTEM = (
    "You are the help desk of a small museum. You answer questions about opening hours, "
    "tickets, guided tours, the cafe and accessibility, briefly and politely."
)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with keyed_server(tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.slow
def test_completions_match_offline_engine(client: openai.OpenAI, srv: ServerProcess) -> None:
    prompt = "The three primary colours are"
    got = client.completions.create(model=None, prompt=prompt, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    llm = LLM("default", max_model_len=512, num_blocks=64)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage is not None and got.usage.completion_tokens == 12
    # echo + logprobs (lm-evaluation-harness's loglikelihood request): the prompt's
    # logprobs, null first, are the offline engine's prompt_logprobs.
    echo = client.completions.create(
        model=srv_model(client), prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    ref = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    )[0]
    assert ref.prompt_logprobs is not None and ref.outputs[0].logprobs is not None
    c = echo.choices[0]
    assert c.text == prompt + ref.outputs[0].text
    assert c.logprobs is not None and c.logprobs.token_logprobs is not None
    ids = ref.prompt_token_ids + ref.outputs[0].token_ids
    assert len(c.logprobs.tokens or []) == len(ids) == len(ref.prompt_token_ids) + 3
    entries = ref.prompt_logprobs + ref.outputs[0].logprobs
    want_lps = [None if e is None else e[t].logprob for t, e in zip(ids, entries, strict=True)]
    assert c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want_lps[1:], abs=1e-3)
    assert all(t is None or len(t) <= 3 for t in c.logprobs.top_logprobs or [])


def srv_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_stream_n_stop_seed_logprobs(client: openai.OpenAI, srv: ServerProcess) -> None:
    model = srv_model(client)
    msgs: Any = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "When do you open?"},
    ]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    text = full.choices[0].message.content or ""
    parts, usage = [], None
    for chunk in client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
    assert "".join(parts) == text and usage is not None and usage.completion_tokens == 16
    # The second identical prompt reuses the first one's prefix blocks.
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens
    kw: Any = dict(model=model, messages=msgs, max_tokens=12, temperature=1.0, seed=7, n=2)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2
    words = text.split()
    if len(words) > 2:
        stopped = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=16, temperature=0, stop=[words[2]]
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert words[2] not in (stopped.choices[0].message.content or "")
    lp = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = lp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_32_concurrent_streams_complete(srv: ServerProcess) -> None:
    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[str | None, int]:
        stream = await ac.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Question number {i}: is the cafe open?"},
            ],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        reason, tokens = None, 0
        async for chunk in stream:
            for ch in chunk.choices:
                reason = ch.finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return reason, tokens

    async def main() -> list[tuple[str | None, int]]:
        ac = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))
        finally:
            await ac.close()

    results = asyncio.run(main())
    assert results == [("length", 16)] * 32
    wait_idle(srv)


def test_disconnect_frees_blocks(srv: ServerProcess) -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    url, headers = srv.url + "/v1/completions", {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(srv, "vllm:kv_cache_usage_perc") > 0
    wait_idle(srv)  # closing the stream aborted the request and freed its blocks


def test_pressed_request_reclaims_blocks(srv: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "The tide comes in twice a day along this coast. " * 30
    before = metric(srv, "kvstack:reclaimed_blocks_total")
    out = client.completions.create(
        model=srv_model(client),
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"kv_press": "snapkv", "kv_press_ratio": 0.5},
    )
    assert out.choices[0].text and out.usage is not None
    assert metric(srv, "kvstack:reclaimed_blocks_total") > before
    assert metric(srv, "kvstack:pressed_requests_total") >= 1
    wait_idle(srv)


def test_auth_tokenize_pin_reset_and_request_log(srv: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    bad = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(srv.url + "/reset_prefix_cache").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    # With a key the token tools need it too (CPU work; SECURITY.md, --open-endpoints).
    assert httpx.post(srv.url + "/tokenize", json={"prompt": "Hi"}).status_code == 401
    tok = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello world"}, headers=auth).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(srv.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()[
        "prompt"
    ]
    assert "Hello world" in text
    bad_ids = httpx.post(srv.url + "/detokenize", json={"tokens": [-1]}, headers=auth)
    assert bad_ids.status_code == 400
    assert httpx.get(srv.url + "/version").json()["version"]
    assert httpx.post(srv.url + "/reset_prefix_cache", headers=auth).status_code == 200
    sys_msg = [{"role": "system", "content": SYSTEM * 2}]
    pin = httpx.post(
        f"{srv.url}/v1/cache/pin", json={"messages": sys_msg}, headers=auth, timeout=60
    )
    assert pin.status_code == 200 and pin.json()["pinned_tokens"] >= 32, pin.text
    r = client.chat.completions.create(
        model=srv_model(client),
        messages=[*sys_msg, {"role": "user", "content": "Tickets?"}],  # type: ignore[list-item]
        max_tokens=2,
    )
    assert r.usage and r.usage.prompt_tokens_details
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= pin.json()["pinned_tokens"]
    unpin = httpx.post(srv.url + "/v1/cache/unpin", json={"messages": sys_msg}, headers=auth)
    assert unpin.json() == {"unpinned": True}
    log = Path(srv.log.parent / "requests.jsonl").read_text().splitlines()
    rec = json.loads(log[-1])
    assert rec["prompt_token_ids"] and rec["num_cached_tokens"] >= 32 and rec["ttft_s"] > 0
    wait_idle(srv)


def test_zz_pool_clean_after_everything(srv: ServerProcess) -> None:
    wait_idle(srv)


def test_bench_serve_against_the_server(srv: ServerProcess, tmp_path: Path) -> None:
    from kvstack.cli import main

    argv = [
        "bench",
        "serve",
        "--base-url",
        srv.url,
        "--api-key",
        KEY,
        "--workload",
        "shared-prefix",
        "--num-prompts",
        "8",
        "--max-tokens",
        "4",
        "--request-rate",
        "inf",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "r.json",
        "--disable-tqdm",
    ]
    assert main(argv) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 8 and res["failed"] == 0 and res["cached_prompt_tokens"] > 0
    wait_idle(srv)


def read_sse_batches(resp: httpx.Response, n: int, timeout_s: float = 30.0) -> list[dict]:
    """The first ``n`` ``data:`` batches of a KV event stream (keep-alives skipped)."""
    out: list[dict] = []
    deadline = time.monotonic() + timeout_s
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))
            if len(out) == n:
                break
        assert time.monotonic() < deadline, f"only {len(out)} of {n} batches"
    return out


def test_load_and_kv_event_stream(srv: ServerProcess) -> None:
    """`/load` gives what a router needs; `/v1/kv_events` starts with a snapshot and then
    announces the exact chained hashes of a new prompt's blocks (kvstack.kv.hashing)."""
    from kvstack.kv.hashing import hash_blocks, root_hash

    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(srv.url + "/load").status_code == 401  # --api-key: /load needs it
    load = httpx.get(srv.url + "/load", headers=headers).json()
    assert load["role"] == "both" and load["block_size"] == 16
    assert load["num_requests_running"] >= 0 and 0 <= load["kv_cache_usage_perc"] <= 1
    assert httpx.get(srv.url + "/v1/kv_events").status_code == 401
    ids = [1000 + i for i in range(70)]  # 4 full blocks, never sent before
    want = [h.hex() for h in hash_blocks(ids, 16, root_hash(load["model_id"], None))]
    with httpx.stream("GET", srv.url + "/v1/kv_events", headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
        assert first["seq"] == 0 and first["snapshot"] is True
        assert first["events"][0]["type"] == "BlockSnapshot"
        assert not set(want) & set(first["events"][0]["block_hashes"])
        body = {"prompt": ids, "max_tokens": 2, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, headers=headers).is_success
        stored: list[str] = []
        seq = 0
        deadline = time.monotonic() + 30
        for line in lines:
            assert time.monotonic() < deadline
            if not line.startswith("data: "):
                continue
            batch = json.loads(line[6:])
            assert batch["seq"] == seq + 1 and batch["snapshot"] is False
            seq = batch["seq"]
            stored += [
                h for e in batch["events"] if e["type"] == "BlockStored" for h in e["block_hashes"]
            ]
            if set(want) <= set(stored):
                break
    with httpx.stream("GET", srv.url + "/v1/kv_events", headers=headers, timeout=30) as r:
        snap = read_sse_batches(r, 1)[0]
        assert set(want) <= set(snap["events"][0]["block_hashes"])  # a reconnect sees them
