"""Fake ``kvstack serve`` replicas and an in-process router for the router tests.

Every fake replica is a tiny aiohttp app on a free loopback port implementing what the
router uses of ``kvstack serve``: ``/health``, ``/load``, ``/v1/kv_events`` (a snapshot,
then batches the test pushes), the two completion routes (JSON or SSE), and knobs to
refuse connections (``stop``), hang, answer 503, die or stall mid-stream. The fakes and the
router (uvicorn) share one background event loop; tests talk HTTP to them with httpx.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import uvicorn
from aiohttp import web

from kvstack.route.policy import BalanceConfig, RoutingPolicy, make_policy
from kvstack.route.policy.kv_index import BlockHasher
from kvstack.route.router.app import RouterConfig, create_router_app
from kvstack.route.router.backends import BackendPool

MODEL_ID = "fake-model"
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def hexes(ids: list[int]) -> list[str]:
    return [h.hex() for h in BlockHasher(BLOCK, MODEL_ID).hashes(ids)]


class BgLoop:
    """An asyncio loop in a daemon thread; ``run`` executes a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class FakeReplica:
    """A stand-in for ``kvstack serve``; ``mode``: ok | 500 | 503 | hang | die_midstream |
    stall_midstream (silent, failing /health) | idle_midstream (silent, healthy) |
    no_blank_lines (3 MiB of one SSE event, then waits for ``release`` up to 10 s)."""

    def __init__(self, bg: BgLoop, name: str, role: str = "both") -> None:
        self.bg, self.name, self.role = bg, name, role
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode = "ok"
        self.model_id = MODEL_ID
        self.health_hang = False
        self.events_ok = True
        self.device_hashes: list[str] = []
        self.received: list[tuple[str, bytes, dict[str, str]]] = []
        self.release = threading.Event()  # no_blank_lines: finish the event
        self.release_timed_out = False
        self._queues: list[asyncio.Queue[tuple[list[dict[str, Any]], int] | None]] = []
        self._runner: web.AppRunner | None = None

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(b) for _, b, _ in self.received]

    def start(self) -> FakeReplica:
        async def go() -> None:
            app = web.Application()
            app.router.add_get("/health", self._health)
            app.router.add_get("/load", self._load)
            app.router.add_get("/v1/kv_events", self._events)
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/completions", self._complete)
            app.router.add_post("/v1/chat/completions", self._complete)
            self._runner = web.AppRunner(app, shutdown_timeout=0.1)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

        self.bg.run(go())
        return self

    def stop(self) -> None:
        async def go() -> None:
            for q in self._queues:
                q.put_nowait(None)
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None

        self.bg.run(go())

    def _send(self, item: tuple[list[dict[str, Any]], int] | None) -> None:
        def send() -> None:
            for q in self._queues:
                q.put_nowait(item)

        self.bg.call(send)

    def push(self, events: list[dict[str, Any]], seq_step: int = 1) -> None:
        """One batch on every open event stream (``seq_step`` > 1 makes a gap)."""
        self._send((events, seq_step))

    def drop_events(self) -> None:
        """End every open event stream (the replica stays up)."""
        self._send(None)

    async def _health(self, _: web.Request) -> web.Response:
        if self.health_hang:
            await asyncio.sleep(3600)
        return web.Response(status=200)

    async def _load(self, _: web.Request) -> web.Response:
        return web.json_response({
            "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.1,
            "block_size": BLOCK, "model_id": self.model_id, "role": self.role,
            "served_model_name": "fake",
        })  # fmt: skip

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "by": self.name}]})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if not self.events_ok:
            return web.json_response({"error": "no events"}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        q: asyncio.Queue[tuple[list[dict[str, Any]], int] | None] = asyncio.Queue()
        self._queues.append(q)
        snap = [{"type": "BlockSnapshot", "block_hashes": self.device_hashes, "medium": "device"}]
        seq = 0
        try:
            await resp.write(sse({"seq": seq, "ts": 0.0, "snapshot": True, "events": snap}))
            while (item := await q.get()) is not None:
                events, step = item
                seq += step
                await resp.write(sse({"seq": seq, "ts": 0.0, "snapshot": False, "events": events}))
        finally:
            self._queues.remove(q)
        return resp

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received.append((request.path, raw, dict(request.headers)))
        try:
            body = json.loads(raw)
        except ValueError:
            return web.json_response({"error": {"message": "malformed JSON"}}, status=400)
        if self.mode == "500":  # a request-specific internal error; the backend is fine
            err = {"error": {"message": "internal error: boom", "type": "server_error"}}
            return web.json_response(err, status=500)
        if self.mode == "503":
            return web.json_response({"error": {"message": "engine dead"}}, status=503)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "replica": self.name,
                    "choices": [{"index": 0, "text": f"hi from {self.name}"}],
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "no_blank_lines":
            return await self._one_long_event(resp)
        for i in range(4):
            await resp.write(sse({"id": "cmpl-1", "choices": [{"index": 0, "text": f"t{i}"}]}))
            await asyncio.sleep(0.01)
            if self.mode == "die_midstream" and i == 1:
                assert request.transport is not None
                request.transport.abort()
                return resp
            if self.mode == "stall_midstream" and i == 1:  # SIGSTOP-like: alive, silent
                self.health_hang = True
                await asyncio.sleep(3600)
            if self.mode == "idle_midstream" and i == 1:
                await asyncio.sleep(3600)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _one_long_event(self, resp: web.StreamResponse) -> web.StreamResponse:
        await resp.write(b"data: ")
        for _ in range(48):
            await resp.write(b"x" * 65536)
        deadline = time.monotonic() + 10.0
        while not self.release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.release_timed_out = not self.release.is_set()
        await resp.write(b"\n\ndata: [DONE]\n\n")
        return resp


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


class FakeTokenizer:
    """Character codes: enough for routing, which only needs stable token ids."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>")


class RouterUnderTest:
    """``create_router_app`` served by uvicorn on the background loop."""

    def __init__(self, bg: BgLoop, urls: list[str], policy: str = "round_robin",
                 health_interval: float = 0.1, tokenizer: Any = None,
                 **cfg: Any) -> None:  # fmt: skip
        self.bg = bg
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool = BackendPool(
            urls, health_interval=health_interval, health_timeout=0.3, fail_threshold=2
        )
        balance = BalanceConfig(balance_abs=8)

        def factory(block_size: int, model_id: str) -> RoutingPolicy:
            return make_policy(policy, block_size=block_size, model_id=model_id, balance=balance)

        config = RouterConfig(status_interval_s=None, **cfg)
        self.app = create_router_app(self.pool, factory, tokenizer or FakeTokenizer(), config)
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.task = bg.run(self._start())
        key = cfg.get("api_key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, timeout=10.0, headers=headers)

    async def _start(self) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
            if task.done():
                task.result()
        return task

    def state(self) -> dict[str, Any]:
        return dict(self.http.get("/router/state").json())

    def replica(self, url: str) -> dict[str, Any]:
        return next(r for r in self.state()["replicas"] if r["url"] == url)

    def wait_healthy(self, n: int, timeout: float = 5.0) -> None:
        wait_until(lambda: sum(r["healthy"] for r in self.state()["replicas"]) == n,
                   timeout, f"{n} healthy backends")  # fmt: skip

    def complete(self, prompt: Any, **extra: Any) -> httpx.Response:
        return self.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **extra})

    def idle(self) -> bool:
        return all(r["inflight"] == 0 for r in self.state()["replicas"])

    def stop(self) -> None:
        async def go() -> None:
            self.pool.check_integrity()
            policy = self.app.state.router.current_policy
            if policy is not None:
                policy.check_integrity()
            self.server.should_exit = True
            await asyncio.wait_for(self.task, 10)

        wait_until(self.idle, what="no request in flight")  # every attempt was released
        self.http.close()
        self.bg.run(go(), timeout=15)
