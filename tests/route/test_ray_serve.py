"""`kvstack serve --ray`: 2 engine replicas on a local Ray instance behind kvstack's router.

One deployment (one Ray instance) serves the whole module: a multi-turn workload with
outputs identical to one plain engine, the router's view (both replicas, events fresh,
cache affinity), and a replica killed mid-run losing no request that had not streamed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstack import LLM, SamplingParams
from server_util import ServerProcess

pytest.importorskip("ray.serve")

SYSTEM = "You are the help desk of a small museum. Answer briefly and politely."
QUESTIONS = [
    ["When does the museum open?", "And on Sundays?", "Is there a discount for students?"],
    ["Where is the cafe?", "Does it serve lunch?", "Can I bring my own food?"],
    ["Do you offer guided tours?", "How long do they take?", "Are they in French too?"],
    ["Is the museum wheelchair accessible?", "Is there a lift?", "Can I borrow a chair?"],
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ray_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("ray")
    args = ["--ray", "--replicas", "2", "--replica-cpus", "0.5", "--policy", "kv_events"]
    args += ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8"]
    with ServerProcess(args, d / "ray.log", timeout_s=240) as s:
        yield s


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("default", dtype="float32", max_model_len=1024, num_blocks=256)


def chat(url: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return dict(r.json())


def router_state(url: str) -> dict[str, Any]:
    states = httpx.get(url + "/router/state", timeout=10).json()
    assert len(states) == 1, states  # one ingress replica, one router
    return dict(states[0])


@pytest.mark.slow
def test_multi_turn_on_two_replicas_matches_one_engine(ray_srv: ServerProcess, llm: LLM) -> None:
    convs = [[{"role": "system", "content": SYSTEM}] for _ in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    pool = concurrent.futures.ThreadPoolExecutor(len(QUESTIONS))
    for turn in range(3):
        for conv, qs in zip(convs, QUESTIONS, strict=True):
            conv.append({"role": "user", "content": qs[turn]})
        got = list(pool.map(lambda c: chat(ray_srv.url, c), convs))
        want = llm.chat(convs, params)  # type: ignore[arg-type]
        for g, w in zip(got, want, strict=True):
            assert g["choices"][0]["message"]["content"] == w.outputs[0].text
        for conv, g in zip(convs, got, strict=True):
            conv.append({"role": "assistant", "content": g["choices"][0]["message"]["content"]})
    state = router_state(ray_srv.url)
    reps = state["replicas"]
    assert state["policy"] == "kv_events" and len(reps) == 2
    assert all(r["events_fresh"] for r in reps), reps  # both event streams followed
    assert all(r["routed"] > 0 for r in reps), reps  # misses spread over both replicas
    assert state["reasons"].get("affinity", 0) >= len(QUESTIONS), state  # later turns stick
    # Each replica's own server: the later turns were prefix-cache hits where they landed.
    hits = 0.0
    for r in reps:
        text = httpx.get(r["url"] + "/metrics", timeout=10).text
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits"))
        hits += float(line.rsplit(" ", 1)[1])
    assert hits > 0


@pytest.mark.slow
def test_killed_replica_loses_no_unstarted_request(ray_srv: ServerProcess) -> None:
    """SIGKILL one replica while non-streamed requests run: each is retried once on the
    other replica (nothing was sent to the client yet), so every one answers 200."""
    reps = router_state(ray_srv.url)["replicas"]
    victim = reps[0]
    msgs = [
        [{"role": "user", "content": f"Write a long story about a museum cat, part {i}."}]
        for i in range(6)
    ]
    pool = concurrent.futures.ThreadPoolExecutor(len(msgs))
    futures = [pool.submit(chat, ray_srv.url, m, max_tokens=48) for m in msgs]
    time.sleep(1.5)  # requests are in flight on both replicas
    os.kill(int(victim["pid"]), signal.SIGKILL)
    t0 = time.monotonic()
    results = [f.result(timeout=240) for f in futures]
    assert all(r["choices"][0]["finish_reason"] in ("length", "stop") for r in results)
    assert time.monotonic() - t0 < 240
    # Ray Serve, not kvstack, restarts the replica; the deployment keeps serving meanwhile.
    assert chat(ray_srv.url, [{"role": "user", "content": "Hello"}])["choices"]


@pytest.mark.slow
def test_bad_input_through_ray_gets_openai_errors(ray_srv: ServerProcess) -> None:
    r = httpx.post(ray_srv.url + "/v1/completions", content=b"{bad", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(
        ray_srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30
    )
    assert r.status_code == 400 and "error" in r.json()


def test_ray_options_are_checked(tmp_path: Path) -> None:
    from kvstack.cli import main

    assert main(["serve", "--ray", "--replicas", "0"]) == 2
    assert main(["serve", "--ray", "--replica-cpus", "0"]) == 2


@pytest.mark.slow
def test_router_counts_a_burst_before_ray_reports_it_routed() -> None:
    """Ray asks ``choose_replicas`` for a burst of queued requests before it reports any
    of them routed; each decision must see the ones before it, or a shared system prompt
    drags the whole burst onto one replica. No Ray cluster needed: fake replicas."""
    from types import SimpleNamespace

    from kvstack.route.ray.replica import EngineCall
    from kvstack.route.ray.router import KVRequestRouter

    router = KVRequestRouter.__new__(KVRequestRouter)  # the policy part, without Ray
    router.initialize_state(policy="prefix")
    reps = [
        SimpleNamespace(
            replica_id=SimpleNamespace(unique_id=name),
            replica_metadata={"url": "", "block_size": 16, "model_id": "m"},
            routing_stats={},
        )
        for name in ("a", "b")
    ]
    system = list(range(1000, 1400))  # 25 shared blocks, then 4 of each session's own
    pending = [
        SimpleNamespace(
            args=[EngineCall("POST", "/v1/completions", b"", {}, (*system, *range(s, s + 64)))],
            metadata=SimpleNamespace(internal_request_id=f"r{s}"),
        )
        for s in range(8)
    ]
    chosen = [
        asyncio.run(router.choose_replicas(reps, p))[0][0].replica_id.unique_id for p in pending
    ]  # type: ignore[arg-type]
    assert sorted(chosen).count("a") == 4, chosen  # misses and balance alternate: 4 / 4
    assert router.inflight == {"a": 4, "b": 4}
    again = asyncio.run(router.choose_replicas(reps, pending[0]))  # type: ignore[arg-type]
    assert again[0][0].replica_id.unique_id == chosen[0]  # asked again: same answer
    assert router.inflight == {"a": 4, "b": 4}  # and not counted twice
    for p, name in zip(pending, chosen, strict=True):
        router.on_request_routed(p, SimpleNamespace(unique_id=name), None)  # type: ignore[arg-type]
        router.on_request_completed(SimpleNamespace(unique_id=name), p.metadata.internal_request_id)  # type: ignore[arg-type]
    assert router.inflight == {"a": 0, "b": 0} and not router._decisions
