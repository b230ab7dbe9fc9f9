"""The router's own bounds against fake replicas: it tokenizes off its event loop (a
template over a large body left ``/health`` unanswered for 47 s and a healthy backend
was ejected), ``/metrics`` needs the key as ``/router/state`` does (it names every
backend), and an SSE event without an end is relayed, not held whole."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx

from kvstack.route.router.workers import BoundedWorkers
from router_util import FakeReplica, FakeTokenizer

HEALTH_BOUND_S = 2.0  # generous: /health answers in milliseconds when the loop is free


class SlowTokenizer(FakeTokenizer):
    """Stands for a chat template over a large body: seconds of CPU per request."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        time.sleep(3.0)
        return super().encode(text)


def test_the_router_tokenizes_off_its_event_loop(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    a, b = fakes
    tok = SlowTokenizer()
    router = make_router([a.url, b.url], policy="prefix", tokenizer=tok, health_interval=0.2)
    router.wait_healthy(2)
    done: dict[str, Any] = {}
    poster = threading.Thread(target=lambda: done.setdefault("r", router.complete("x" * 1000)))
    poster.start()
    assert tok.started.wait(10), "the body was never tokenized"
    latencies = []
    while poster.is_alive() and len(latencies) < 20:
        t0 = time.perf_counter()
        assert router.http.get("/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    poster.join(30)
    assert done["r"].status_code == 200
    assert tok.threads and all(t.startswith("kvstack-route-tokenize") for t in tok.threads)
    print(f"router /health while a body is tokenized: max {max(latencies):.3f} s")
    assert latencies and max(latencies) < HEALTH_BOUND_S
    assert all(r["healthy"] and r["ejections"] == 0 for r in router.state()["replicas"])


def test_router_metrics_need_the_key_unless_opened(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    a, _ = fakes
    keyed = make_router([a.url], api_key="k")
    keyed.wait_healthy(1)
    bare = httpx.get(keyed.url + "/metrics")
    assert bare.status_code == 401 and a.url not in bare.text
    assert a.url in keyed.http.get("/metrics").text  # with the key: every series
    assert httpx.get(keyed.url + "/router/state").status_code == 401
    opened = make_router([a.url], api_key="k", open_metrics=True)
    opened.wait_healthy(1)
    assert httpx.get(opened.url + "/metrics").status_code == 200
    assert httpx.get(opened.url + "/health").status_code == 200  # probes carry no key


def test_an_sse_event_without_an_end_is_relayed_not_held(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    """The relay buffered until a blank line with no limit: a backend streaming without
    one had nothing reach the client before its timeout (~150 MB held)."""
    a, b = fakes
    b.stop()
    router = make_router([a.url])
    router.wait_healthy(1)
    a.mode = "no_blank_lines"
    got = 0
    early = False
    with router.http.stream(
        "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}
    ) as r:
        assert r.status_code == 200
        for chunk in r.iter_bytes():
            got += len(chunk)
            if got >= 2 << 20 and not a.release.is_set():
                early = not a.release_timed_out
                a.release.set()
    assert early and not a.release_timed_out
    assert got == len(b"data: ") + 48 * 65536 + len(b"\n\ndata: [DONE]\n\n")
    a.mode = "ok"
    b.start()


def test_a_full_tokenizing_backlog_routes_by_load_at_once() -> None:
    """Past the backlog a body is not queued behind the others: it gets the fallback (no
    token ids: a cache miss, routed by load) without waiting."""
    workers = BoundedWorkers(1, 2, "test-route-tokenize")
    gate = threading.Event()

    def blocked() -> str:
        gate.wait(10)
        return "tokens"

    async def flood() -> list[str]:
        jobs = [asyncio.ensure_future(workers.run(blocked, "by load")) for _ in range(2)]
        await asyncio.sleep(0.05)  # both submitted: one runs, one waits
        third = await workers.run(blocked, "by load")  # answered before the gate opens
        assert workers.pending == 2 and workers.num_skipped == 1
        gate.set()
        return [third, *await asyncio.gather(*jobs)]

    try:
        assert asyncio.run(flood()) == ["by load", "tokens", "tokens"]
        assert workers.pending == 0
    finally:
        gate.set()
        workers.close()
