"""``kvstack router``'s HTTP front: an OpenAI-compatible FastAPI app that proxies.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (routed and proxied by
:class:`~kvstack.route.router.proxy.Router`, streaming included), ``GET /v1/models`` (forwarded to a
healthy backend), ``GET /health`` (200 iff at least one backend can serve), ``GET /metrics``
(the router's own ``kvstack_router:*`` registry; it needs the API key when one is set,
unless ``open_metrics``, since it names every backend) and ``GET /router/state`` (each backend's
health, role, load, in-flight count and KV-event freshness, plus the policy's name; it
needs the API key when one is set, since it lists the backends).

Errors are the server's OpenAI shape (``serve.protocol.error_body``): 401 wrong API key
(the same ``Authorization: Bearer`` check as ``kvstack serve``; the header is passed on to
the backends), 413 body over ``max_body_bytes``, 503 no healthy backend, 502 backends
failed. Everything else (400s, 429s) is the backend's own answer, passed through.
The lifespan starts the pool's health / DNS / event loops and a status log line every
``status_interval_s`` seconds, and stops them on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import kvstack
from kvstack.route.policy import RoutingPolicy
from kvstack.route.router.backends import BackendPool
from kvstack.route.router.event_sources import EventEndpoints
from kvstack.route.router.proxy import SERVING_ROLES, PolicyFactory, ProxyConfig, Router
from kvstack.serve.api.http_errors import ApiError, check_bearer, install_error_handlers, read_body

logger = logging.getLogger("kvstack.route")


@dataclass
class RouterConfig:
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float | None = None  # a backend's first byte (non-stream: the answer)
    prefill_timeout_s: float = 30.0
    # Longest silence of a backend's response (first byte included) before it is cut.
    idle_timeout_s: float | None = 600.0
    body_timeout_s: float | None = 30.0  # a client's whole body (408 past it)
    status_interval_s: float | None = 10.0  # None: no periodic status line
    policy_name: str | None = None  # shown by /router/state before a factory builds it
    # With api_key: /metrics needs it too (its per-backend series name every backend, as
    # /router/state does) unless opened (``--open-endpoints metrics``, SECURITY.md).
    open_metrics: bool = False
    # --policy kv_events: backends followed over ZMQ (event_sources.py), and the topic.
    event_endpoints: EventEndpoints = field(default_factory=EventEndpoints)
    event_topic: str = ""


def status_line(router: Router) -> str:
    """One log line: totals, then each backend's health and load."""
    m = router.metrics
    parts = [
        f"{m.total(m.requests):.0f} routed, {m.total(m.retries):.0f} retries, "
        f"{m.total(m.backend_failures):.0f} backend failures, "
        f"{m.total(m.stream_errors):.0f} cut streams"
    ]
    for b in router.pool.backends.values():
        r = b.replica
        state = "up" if b.healthy else "DOWN"
        parts.append(
            f"{b.id} {state} {b.role} load={r.load} inflight={r.inflight} kv={r.kv_usage:.0%}"
        )
    return " | ".join(parts)


async def _wait_disconnect(raw: Request) -> None:
    """Returns when the client hangs up (the body has already been read)."""
    while (await raw.receive())["type"] != "http.disconnect":
        continue


def create_router_app(
    pool: BackendPool,
    policy: RoutingPolicy | PolicyFactory,
    tokenizer: Any,
    config: RouterConfig | None = None,
) -> FastAPI:
    """The router app. ``policy`` may be a factory ``(block_size, model_id) -> policy``,
    built when the first backend reports those in ``/load``."""
    cfg = config or RouterConfig()
    router = Router(
        pool,
        policy,
        tokenizer,
        ProxyConfig(
            cfg.request_timeout_s,
            cfg.prefill_timeout_s,
            cfg.idle_timeout_s,
            event_endpoints=cfg.event_endpoints,
            event_topic=cfg.event_topic,
        ),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        status = None
        if cfg.status_interval_s:
            status = asyncio.create_task(_status_loop(router, cfg.status_interval_s))
        try:
            yield
        finally:
            if status is not None:
                status.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await status
            await router.stop()

    app = FastAPI(title="kvstack router", version=kvstack.__version__, lifespan=lifespan)
    app.state.router = router

    install_error_handlers(app, logger)
    _add_routes(app, router, cfg)
    return app


def _add_routes(app: FastAPI, router: Router, cfg: RouterConfig) -> None:
    pool = router.pool

    def check_auth(raw: Request) -> None:
        check_bearer(raw, cfg.api_key)

    async def proxied(raw: Request) -> Response:
        check_auth(raw)
        body = await read_body(raw, cfg.max_body_bytes, cfg.body_timeout_s)
        return await router.handle(
            raw.url.path, body, raw.headers, disconnected=lambda: _wait_disconnect(raw)
        )

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await proxied(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await proxied(raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        check_auth(raw)
        return await router.forward_get("/v1/models", raw.headers)

    @app.get("/health")
    async def health() -> Response:
        if not pool.healthy(SERVING_ROLES):
            raise ApiError(503, "no healthy backend", "server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        if not cfg.open_metrics:
            check_auth(raw)
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def state(raw: Request) -> dict[str, Any]:
        check_auth(raw)
        pol = router.current_policy
        return {
            "policy": pol.name if pol is not None else cfg.policy_name,
            "block_size": pool.block_size,
            "model_id": pool.model_id,
            "replicas": pool.state(),
        }


async def _status_loop(router: Router, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        logger.info("router: %s", status_line(router))
