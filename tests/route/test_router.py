"""``kvstack router`` against fake replicas (no model): proxying, KV-aware choice, faults.

The fakes (``router_util.FakeReplica``) implement what the router uses of ``kvstack
serve``, with knobs to refuse connections, hang, answer 503, die or stall mid-stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from kvstack.core.errors import ConfigError
from kvstack.route.router.app import status_line
from kvstack.route.router.backends import BackendPool
from kvstack.route.router.cli import add_router_args, run_router
from kvstack.route.router.discovery import parse_networks
from kvstack.route.router.events_client import SSEParser
from router_util import (
    BLOCK,
    MODEL_ID,
    BgLoop,
    FakeReplica,
    free_port,
    hexes,
    sse,
    wait_until,
)


def test_proxies_json_and_streams_in_order(fakes: list[FakeReplica], make_router: Any) -> None:
    a, b = fakes
    router = make_router([a.url, b.url])
    router.wait_healthy(2)
    r = router.complete("hello")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    direct = httpx.post(a.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert r.json() == direct.json() and r.headers["x-kvstack-replica"] == a.url
    assert a.received[0][1] == r.request.content  # the client's bytes, unchanged
    with router.http.stream("POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True,
    }) as s:  # fmt: skip
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        streamed = b"".join(s.iter_raw())
    expected = b"".join(sse({"id": "cmpl-1", "choices": [{"index": 0, "text": f"t{i}"}]})
                        for i in range(4)) + b"data: [DONE]\n\n"  # fmt: skip
    assert streamed == expected
    assert [p for p, _, _ in b.received] == ["/v1/chat/completions"]
    models = router.http.get("/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake"
    assert router.http.get("/health").status_code == 200
    bad = router.http.post("/v1/completions", content=b"{not json")  # routed, backend's 400
    assert bad.status_code == 400 and "malformed" in bad.json()["error"]["message"]


def test_prefix_policy_affinity_and_spread(fakes: list[FakeReplica], make_router: Any) -> None:
    router = make_router([f.url for f in fakes], policy="prefix")
    router.wait_healthy(2)
    shared = "You are a helpful assistant. " * 4  # 116 characters: 7 full blocks
    seen = {router.complete(shared + "Q1").headers["x-kvstack-replica"] for _ in range(4)}
    assert len(seen) == 1  # the same prompt always goes where its prefix went
    spread = [router.complete(f"{i} unrelated prompt number {i} " * 3) for i in range(6)]
    assert {r.headers["x-kvstack-route"] for r in spread} == {"miss"}
    assert {r.headers["x-kvstack-replica"] for r in spread} == {f.url for f in fakes}


def test_kv_events_follow_stream_degrade_and_recover(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    a, b = fakes
    p, q, s = ([base + i for i in range(64)] for base in (1000, 2000, 3000))
    b.device_hashes = hexes(p)
    router = make_router([a.url, b.url], policy="kv_events")
    router.wait_healthy(2)
    wait_until(lambda: all(r["events"]["fresh"] for r in router.state()["replicas"]),
               what="fresh event streams")  # fmt: skip
    r = router.complete(p)
    assert (r.headers["x-kvstack-replica"], r.headers["x-kvstack-route"]) == (b.url, "affinity")
    a.push([{"type": "BlockStored", "block_hashes": hexes(q), "parent_block_hash": None,
             "token_ids": q, "block_size": BLOCK, "medium": "host"}])  # fmt: skip
    wait_until(lambda: router.replica(a.url)["events"]["batches"] >= 2, what="a's batch")
    r = router.complete(q)
    assert (r.headers["x-kvstack-replica"], r.headers["x-kvstack-route"]) == (a.url, "affinity")
    # b's stream drops and cannot reconnect: b is stale, its approximate index takes over.
    b.events_ok = False
    b.drop_events()
    wait_until(lambda: not router.replica(b.url)["events"]["fresh"], what="b stale")
    r = router.complete(p)  # still b: the router had sent p there
    assert (r.headers["x-kvstack-replica"], r.headers["x-kvstack-route"]) == (b.url, "affinity")
    r = router.complete(s)  # b's new blocks are unknown while stale: a miss
    assert r.headers["x-kvstack-route"] == "miss"
    b.device_hashes = hexes(s) + hexes(p)
    b.events_ok = True
    wait_until(lambda: router.replica(b.url)["events"]["fresh"], 8.0, "b fresh again")
    for prompt in (s, p):
        r = router.complete(prompt)
        assert (r.headers["x-kvstack-replica"], r.headers["x-kvstack-route"]) == (b.url, "affinity")
    # A sequence gap makes b stale at once; the follower reconnects for a snapshot.
    connects = router.replica(b.url)["events"]["connects"]
    b.push([])
    wait_until(lambda: router.replica(b.url)["events"]["batches"] >= 2, what="b's batch")
    assert router.replica(b.url)["events"]["fresh"]
    assert router.replica(b.url)["events"]["connects"] == connects
    b.push([], seq_step=5)
    wait_until(lambda: router.replica(b.url)["events"]["connects"] > connects, 5.0, "resync")
    wait_until(lambda: router.replica(b.url)["events"]["fresh"], 5.0, "b fresh after resync")


def test_retry_once_before_first_byte(fakes: list[FakeReplica], make_router: Any) -> None:
    a, b = fakes
    router = make_router([a.url, b.url], health_interval=30.0)  # the router finds out itself
    router.wait_healthy(2)
    a.mode = "503"
    r = router.complete("x", stream=True)
    assert r.status_code == 200 and r.headers["x-kvstack-replica"] == b.url
    assert r.text.endswith("data: [DONE]\n\n") and len(a.received) == 1
    a.mode = "ok"
    a.stop()  # refuses connections; the pool still thinks it is healthy
    for _ in range(3):
        r = router.complete("y")
        assert r.status_code == 200 and r.json()["replica"] == "b"
    metrics = router.http.get("/metrics").text
    assert "kvstack_router:retries_total 2.0" in metrics
    assert f'kvstack_router:backend_failures_total{{replica="{a.url}"}} 2.0' in metrics
    assert not router.replica(a.url)["healthy"]  # request failures + recheck ejected it
    a.start()


def test_killed_mid_stream_gets_error_event_no_retry(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    a, b = fakes
    router = make_router([a.url, b.url])
    router.wait_healthy(2)
    a.mode = "die_midstream"
    with router.http.stream("POST", "/v1/completions",
                            json={"prompt": "x", "stream": True}) as s:  # fmt: skip
        assert s.status_code == 200
        text = b"".join(s.iter_raw()).decode()
    events = [e[len("data: ") :] for e in text.split("\n\n") if e]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert len(a.received) == 1 and not b.received
    assert "kvstack_router:retries_total 0.0" in router.http.get("/metrics").text


def test_hung_backend_is_ejected_and_request_completes_elsewhere(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    a, b = fakes
    router = make_router([a.url, b.url])
    router.wait_healthy(2)
    a.mode, a.health_hang = "hang", True
    start = time.monotonic()
    r = router.complete("x")
    assert r.status_code == 200 and r.json()["replica"] == "b" and len(a.received) == 1
    assert time.monotonic() - start < 5.0
    assert not router.replica(a.url)["healthy"]
    a.mode, a.health_hang = "ok", False
    router.wait_healthy(2)  # readmitted after one passing check


def test_hung_mid_stream_is_cut_with_an_error_event(
    fakes: list[FakeReplica], make_router: Any
) -> None:
    a, b = fakes
    router = make_router([a.url, b.url])
    router.wait_healthy(2)
    a.mode = "stall_midstream"
    start = time.monotonic()
    r = router.complete("x", stream=True)
    events = [e[len("data: ") :] for e in r.text.split("\n\n") if e]
    assert len(events) == 4 and "ejected" in json.loads(events[2])["error"]["message"]
    assert time.monotonic() - start < 5.0 and not b.received
    a.mode, a.health_hang = "ok", False


def test_request_timeout_retries_elsewhere(fakes: list[FakeReplica], make_router: Any) -> None:
    a, b = fakes
    router = make_router([a.url, b.url], request_timeout_s=0.3)
    router.wait_healthy(2)
    a.mode = "hang"  # /health still fine: only the timeout catches it
    r = router.complete("x")
    assert r.status_code == 200 and r.json()["replica"] == "b" and len(a.received) == 1
    assert "kvstack_router:retries_total 1.0" in router.http.get("/metrics").text


def test_all_down_503_and_readmission(fakes: list[FakeReplica], make_router: Any) -> None:
    a, b = fakes
    router = make_router([a.url, b.url])
    router.wait_healthy(2)
    a.stop()
    wait_until(lambda: not router.replica(a.url)["healthy"], what="a ejected")
    assert router.replica(b.url)["healthy"]
    b.stop()
    router.wait_healthy(0)
    r = router.complete("x")
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert router.http.get("/health").status_code == 503
    a.start()
    router.wait_healthy(1)
    assert router.complete("x").json()["replica"] == "a"
    b.start()
    router.wait_healthy(2)
    state = router.replica(a.url)
    assert state["ejections"] == 1 and state["consecutive_failures"] == 0


def test_backend_of_another_model_is_kept_out(fakes: list[FakeReplica], make_router: Any) -> None:
    a, b = fakes
    router = make_router([a.url])
    router.wait_healthy(1)
    b.model_id = "another-model"

    async def add() -> None:
        router.pool.add(b.url)

    router.bg.run(add())
    wait_until(lambda: "another-model" in (router.replica(b.url)["mismatch"] or ""),
               what="b rejected")  # fmt: skip
    assert not router.replica(b.url)["healthy"]
    assert router.state()["model_id"] == MODEL_ID
    b.model_id = MODEL_ID  # redeployed with the pool's model
    router.wait_healthy(2)


def test_prefill_decode_sequencing(bg: BgLoop, make_router: Any) -> None:
    pre, dec = FakeReplica(bg, "p", "prefill").start(), FakeReplica(bg, "d", "decode").start()
    try:
        router = make_router([pre.url, dec.url], policy="kv_events")
        router.wait_healthy(2)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        r = router.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["x-kvstack-replica"] == dec.url
        assert pre.bodies() == [{"messages": body["messages"], "max_tokens": 1, "stream": False,
                                 "n": 1}]  # fmt: skip
        assert dec.received[0][1] == r.request.content
        pre.mode = "503"  # the handoff fails: decode recomputes
        r = router.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and len(dec.received) == 2 and len(pre.received) == 2
        metrics = router.http.get("/metrics").text
        assert "kvstack_router:prefill_handoffs_total 1.0" in metrics
        assert "kvstack_router:prefill_failures_total 1.0" in metrics
        pre.mode = "ok"
        dec.stop()  # only a prefill replica left: nothing can decode
        wait_until(lambda: router.http.get("/health").status_code == 503, what="no decode")
        assert router.http.post("/v1/chat/completions", json=body).status_code == 503
        dec.start()
    finally:
        pre.stop()
        dec.stop()


def test_auth_body_limit_and_metrics(fakes: list[FakeReplica], make_router: Any) -> None:
    a, _ = fakes
    router = make_router([f.url for f in fakes], api_key="k", max_body_bytes=1000)
    router.wait_healthy(2)
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = router.http.post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and "error" in r.json()
    r = router.http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200 and a.received[-1][2]["Authorization"] == "Bearer k"
    metrics = router.http.get("/metrics").text
    for name in ("requests_total{", "retries_total", "backend_healthy{", "inflight{",
                 "matched_blocks_total", "prompt_blocks_total"):  # fmt: skip
        assert f"kvstack_router:{name}" in metrics, name
    assert f'kvstack_router:backend_healthy{{replica="{a.url}"}} 1.0' in metrics


def test_dns_discovery_adds_and_removes() -> None:
    port = free_port()  # nothing listens there: the discovered backends stay unhealthy
    static, one, two = "http://127.0.0.1:1", f"http://127.0.0.2:{port}", f"http://[::1]:{port}"

    async def go() -> None:
        answers: asyncio.Queue[list[str] | Exception] = asyncio.Queue()

        async def resolver(host: str, p: int) -> list[str]:
            assert (host, p) == ("engine.svc", port)
            answer = await answers.get()
            if isinstance(answer, Exception):
                raise answer
            return answer

        pool = BackendPool([static], discover_dns=f"engine.svc:{port}", dns_interval=0.01,
                           health_interval=5.0, resolver=resolver,
                           discover_allow=parse_networks(["127.0.0.0/8", "::1"]))  # fmt: skip

        async def expect(urls: set[str]) -> None:
            for _ in range(200):
                if set(pool.backends) == urls and answers.empty():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{set(pool.backends)} != {urls}")

        await pool.start()
        try:
            answers.put_nowait(["127.0.0.2"])
            await expect({static, one})
            answers.put_nowait(["127.0.0.2", "::1"])
            await expect({static, one, two})
            answers.put_nowait(OSError("NXDOMAIN"))  # a failed lookup keeps the set
            await expect({static, one, two})
            answers.put_nowait(["::1"])
            await expect({static, two})
            pool.check_integrity()
        finally:
            await pool.stop()

    asyncio.run(go())


def test_sse_parser_splits_and_joins() -> None:
    p = SSEParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b": 1}\n\n: comment\n\ndata: x\r\ndata: y\n\nda") == ['{"a": 1}', "x\ny"]
    assert p.feed(b"ta:z\n\n") == ["z"]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--backend", "ftp://h:1"],
        ["--backend", "http://h:99999"],
        ["--backend", "http://h:1/v1"],
        ["--backend", "http://h:1", "--backend", "http://h:1/"],
        ["--backend", "http://h:1", "--port", "0"],
        ["--backend", "http://h:1", "--fail-threshold", "0"],
        ["--backend", "http://h:1", "--health-interval", "0"],
        ["--backend", "http://h:1", "--balance-rel", "0.5"],
        ["--backend", "http://h:1", "--balance-abs", "-1"],
        ["--backend", "http://h:1", "--min-match-ratio", "2"],
        ["--backend", "http://h:1", "--request-timeout", "-3"],
        ["--discover-dns", "no-port"],
        ["--discover-dns", "svc:70000"],
    ],
)
def test_cli_bad_input_is_config_error(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    add_router_args(p)
    with pytest.raises(ConfigError):
        run_router(p.parse_args(argv))


def test_cli_options_have_help() -> None:
    p = argparse.ArgumentParser()
    add_router_args(p)
    missing = [a.dest for a in p._actions if a.dest != "help" and not a.help]
    assert not missing


def test_client_gone_releases_attempts(fakes: list[FakeReplica], make_router: Any) -> None:
    a, _ = fakes
    router = make_router([f.url for f in fakes])
    router.wait_healthy(2)
    a.mode = "hang"  # healthy but never answers: the client gives up first
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=0.5)
    assert len(a.received) == 1
    wait_until(router.idle, what="the abandoned attempt released")
    with router.http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as s:
        next(s.iter_raw())  # the client leaves mid-stream
    wait_until(router.idle, what="the stream released")
    line = status_line(router.app.state.router)
    assert "routed" in line and f"{a.url} up both" in line


def test_run_router_serves_and_stops_on_sigterm(fakes: list[FakeReplica], tmp_path: Any) -> None:
    port = free_port()
    code = (
        "import argparse, logging, sys; from kvstack.route.router.cli import add_router_args, "
        "run_router; logging.basicConfig(level=logging.INFO); p = argparse.ArgumentParser(); "
        "add_router_args(p); sys.exit(run_router(p.parse_args(sys.argv[1:])))"
    )
    backends = [x for f in fakes for x in ("--backend", f.url)]
    argv = [sys.executable, "-c", code, "--port", str(port), "--policy", "round_robin",
            "--health-interval", "0.1", *backends]  # fmt: skip
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 (closed in finally)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 15.0, "the router process")

        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["replica"] in ("a", "b")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0

    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "router.log").read_text()
    assert "policy round_robin over" in text and "router stopped" in text
