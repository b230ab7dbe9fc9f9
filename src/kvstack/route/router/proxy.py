"""Choose a backend, proxy the request, retry once before the first byte.

:class:`Router` is the request path of ``kvstack router``, free of FastAPI routes so the
Ray Serve ingress can reuse it. Per request:

1. ``route_request``: the prompt's token ids, tokenized exactly as the server does
   (``prompt.prompt_info``), plus ``cache_salt``. A body the router cannot parse routes
   with no tokens (a miss: least load) and the backend answers its 400.
2. Prefill/decode: when the pool has a healthy ``prefill`` backend, the policy picks one
   among the prefill backends, which gets the body with ``stream: false, max_tokens: 1``
   (it stores the prompt's KV in the shared tier); its answer is ignored. A failed or
   timed-out prefill only logs and counts: the decode backend recomputes (Mooncake /
   Dynamo disaggregation with recompute fallback).
3. The policy picks among the ``both`` / ``decode`` backends; the router posts the body
   and waits for the response *and its first body byte*. A refused connection, a timeout,
   a 502/503/504, or an ejection of that backend by the health loop while waiting is a failed
   attempt: reported to the pool and retried ONCE on another backend. Nothing has reached
   the client, so the retry is safe. After the first byte the response is committed: it
   is relayed chunk by chunk and a backend that dies (or is ejected) mid-stream ends an
   SSE response with a final ``data: {"error": ...}`` event, never a retry.

Invariants: ``Replica.inflight`` is incremented exactly once per attempt and decremented
exactly once when the attempt fails or its response ends, however it ends; SSE is relayed
on event boundaries only, so the client never sees half an event before an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.responses import JSONResponse, Response

from kvstack.route.policy import (
    Decision,
    KVEventsPolicy,
    NoReplicaError,
    RouteRequest,
    RoutingPolicy,
)
from kvstack.route.policy.kv_index import EventIndex
from kvstack.route.policy.prompt import prompt_info
from kvstack.route.policy.vllm_index import VllmEventIndex
from kvstack.route.router.backends import Backend, BackendPool
from kvstack.route.router.event_sources import EventEndpoints, EventFeeds
from kvstack.route.router.metrics import RouterMetrics
from kvstack.route.router.relay import relay_response
from kvstack.route.router.workers import BoundedWorkers
from kvstack.serve.api.protocol import error_body

logger = logging.getLogger("kvstack.route")

SERVING_ROLES = ("both", "decode")
PREFILL_ROLES = ("prefill",)
FORWARD_REQUEST_HEADERS = frozenset(
    {"authorization", "content-type", "accept", "x-session-id", "x-request-id"}
)
PolicyFactory = Callable[[int, str], RoutingPolicy]


@dataclass
class ProxyConfig:
    request_timeout_s: float | None = None  # a backend's first byte (non-stream: the answer)
    prefill_timeout_s: float = 30.0
    # The longest a backend may stay silent (before its first byte or mid-stream) before
    # the response is cut: aiohttp's sock_read. None (was the only choice) waits forever
    # on a backend that accepted and went quiet (a slowloris backend).
    idle_timeout_s: float | None = 600.0
    connect_timeout_s: float = 10.0
    # ``--policy kv_events``: the backends followed over ZMQ (the others: SSE), the topic.
    event_endpoints: EventEndpoints = field(default_factory=EventEndpoints)
    event_topic: str = ""


# Answers that say the backend cannot serve (a gateway in front of it failed, it is
# draining or its engine is down): counted toward ejection and retried on another. A 500
# is an error of that one request (a bug its input reached), passed to the client as is:
# counting it would let any client eject a healthy backend with two bad requests; a
# backend that is really down fails its /health checks.
BACKEND_DOWN_STATUSES = frozenset({502, 503, 504})


class AttemptFailed(Exception):
    """One attempt failed before its first byte; ``status``/``body`` if it answered 502,
    503 or 504 (``BACKEND_DOWN_STATUSES``)."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        body: bytes = b"",
        content_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body, self.content_type = status, body, content_type


class ClientGone(Exception):
    """The client disconnected before the backend answered."""


class Router:
    """The routing core: ``pool`` (backends), a policy (or a factory of one, built from
    the ``block_size`` and ``model_id`` the pool learns), the model's tokenizer."""

    def __init__(
        self,
        pool: BackendPool,
        policy: RoutingPolicy | PolicyFactory,
        tokenizer: Any,
        config: ProxyConfig | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.config = config or ProxyConfig()
        self.metrics = metrics or RouterMetrics(pool)
        self.session: aiohttp.ClientSession | None = None
        self._policy: RoutingPolicy | None = None
        self._factory: PolicyFactory | None = None
        self._feeds: EventFeeds | None = None
        # Tokenizing never runs on the event loop (workers.py); past 64 waiting bodies a
        # request is routed by load (a miss) instead of waiting for its tokens.
        self._workers = BoundedWorkers(2, 64, "kvstack-route-tokenize")
        if isinstance(policy, RoutingPolicy):
            self._install(policy)
        else:
            self._factory = policy
            pool.on_model_info.append(lambda bs, mid: self._build(bs, mid))
        pool.on_ejected.append(self._forget)
        pool.on_removed.append(self._forget)

    # -- policy ----------------------------------------------------------------------------

    @property
    def current_policy(self) -> RoutingPolicy | None:
        """The policy if built (a factory waits for the first backend's ``/load``)."""
        return self._policy

    @property
    def policy(self) -> RoutingPolicy:
        if self._policy is None:
            if self.pool.block_size is None:  # no backend reported /load: the defaults
                logger.warning("no backend reported block_size/model_id; hashing with 16, ''")
            self._build(self.pool.block_size or 16, self.pool.model_id or "")
        assert self._policy is not None
        return self._policy

    def _build(self, block_size: int, model_id: str) -> None:
        if self._policy is None and self._factory is not None:
            self._install(self._factory(block_size, model_id))

    def _install(self, policy: RoutingPolicy) -> None:
        self._policy = policy
        if not isinstance(policy, KVEventsPolicy):
            return
        if self._feeds is not None:  # following since start(): the policy adopts the indexes
            policy.index, policy.vllm_index = self._feeds.sse_index, self._feeds.vllm_index
        else:
            self._follow(policy.index, policy.vllm_index)

    def _follow(self, sse_index: EventIndex, vllm_index: VllmEventIndex) -> None:
        cfg = self.config
        self._feeds = EventFeeds(sse_index, vllm_index, cfg.event_endpoints, cfg.event_topic)
        self.pool.follow_events(self._feeds)

    def _forget(self, replica_id: str) -> None:
        # Ejected or removed: it may come back restarted with an empty cache.
        if self._policy is not None:
            self._policy.remove_replica(replica_id)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=self.config.connect_timeout_s,
                    sock_read=self.config.idle_timeout_s,
                ),
            )
        if self._policy is None and self.config.event_endpoints.any and self._feeds is None:
            # ZMQ backends (vLLM's) have no /load to build the policy from: follow their
            # events from the start; the policy, once built, adopts these indexes.
            self._follow(EventIndex(), VllmEventIndex())
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        self._workers.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    # -- request path ----------------------------------------------------------------------

    def route_request(self, path: str, body: bytes) -> RouteRequest:
        """Token ids and cache salt of a request body; no ids if it is not a valid request
        (then the policy sees a miss and picks by load; the backend answers the 400)."""
        info = None
        if self.tokenizer is not None:
            try:
                info = prompt_info(self.tokenizer, path, body)
            except Exception as e:  # e.g. a chat template error: the backend will say it
                logger.debug("cannot tokenize a request for routing: %s", e)
        if info is None:
            return RouteRequest(())
        return RouteRequest(info.token_ids, info.cache_salt, info.segments, info.sink)

    async def handle(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        disconnected: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> Response:
        """Route and proxy one POST to ``path`` (``/v1/completions`` or chat)."""
        rreq = RouteRequest(())  # no tokenizer: nothing to compute
        if self.tokenizer is not None:
            rreq = await self._workers.run(lambda: self.route_request(path, body), rreq)
        fwd = {k: v for k, v in headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
        if self.pool.healthy(PREFILL_ROLES) and self.pool.healthy(SERVING_ROLES):
            try:
                data = json.loads(body)
            except (ValueError, RecursionError):
                data = None
            if isinstance(data, dict):
                await self.prefill(path, data, fwd, rreq)
        return await self.proxy(path, body, fwd, rreq, disconnected)

    def _decide(
        self, rreq: RouteRequest, roles: Collection[str], exclude: Collection[str], first: bool
    ) -> tuple[Backend, Decision]:
        candidates = [r for r in self.pool.replicas(roles) if r.id not in exclude]
        decision = self.policy.choose(rreq, candidates)
        self.policy.on_routed(rreq, decision)
        self.metrics.requests.labels(decision.replica_id, decision.reason).inc()
        if first:
            self.metrics.matched_blocks.inc(decision.matched_blocks)
            self.metrics.prompt_blocks.inc(decision.total_blocks)
        b = self.pool.get(decision.replica_id)
        assert b is not None, f"policy chose unknown replica {decision.replica_id}"
        return b, decision

    async def prefill(
        self, path: str, data: dict[str, Any], headers: Mapping[str, str], rreq: RouteRequest
    ) -> bool:
        """The prefill step of a P/D request; True if a prefill backend finished it."""
        try:
            b, _ = self._decide(rreq, PREFILL_ROLES, (), first=False)
        except NoReplicaError:
            return False
        body = {
            k: v for k, v in data.items() if k not in ("max_completion_tokens", "stream_options")
        }
        body.update(stream=False, max_tokens=1, n=1)
        assert self.session is not None, "start() the router first"
        b.replica.inflight += 1
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s)
            async with self.session.post(
                b.url + path, json=body, headers=headers, timeout=timeout
            ) as r:
                await r.read()
                if r.status in BACKEND_DOWN_STATUSES:
                    self.pool.report_failure(b.id, f"prefill answered {r.status}")
                if r.status != 200:
                    raise AttemptFailed(f"answered {r.status}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not isinstance(e, AttemptFailed):
                self.pool.report_failure(b.id, f"prefill: {why}")
            logger.warning("prefill on %s failed (%s); decode recomputes the prompt", b.id, why)
            self.metrics.prefill_failures.inc()
            return False
        finally:
            b.replica.inflight -= 1
        self.metrics.prefill_handoffs.inc()
        return True

    async def proxy(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        rreq: RouteRequest,
        disconnected: Callable[[], Coroutine[Any, Any, None]] | None = None,
    ) -> Response:
        """Send ``body`` to a serving backend; one retry on another before the first byte."""
        tried: list[str] = []
        last: AttemptFailed | None = None
        for attempt in range(2):
            try:
                b, decision = self._decide(rreq, SERVING_ROLES, tried, first=attempt == 0)
            except NoReplicaError as e:
                if last is None:
                    self.metrics.no_replica.inc()
                    return JSONResponse(
                        error_body(str(e), "server_error", code=503), status_code=503
                    )
                break
            if attempt:
                self.metrics.retries.inc()
            tried.append(b.id)
            b.replica.inflight += 1
            try:
                resp, first = await self._attempt(b, path, body, headers, disconnected)
            except AttemptFailed as e:
                b.replica.inflight -= 1
                last = e
                self.metrics.backend_failures.labels(b.id).inc()
                self.pool.report_failure(b.id, str(e))
                logger.warning(
                    "request to %s failed before its first byte (%s)%s",
                    b.id,
                    e,
                    "; retrying on another backend" if attempt == 0 else "",
                )
                continue
            except ClientGone:
                b.replica.inflight -= 1
                return Response(status_code=499)
            except BaseException:
                b.replica.inflight -= 1
                raise
            headers_out = {"x-kvstack-replica": b.id, "x-kvstack-route": decision.reason}
            return relay_response(b, resp, first, headers_out, self.pool, self.metrics)
        assert last is not None
        if last.status is not None:  # the backend's own 5xx answer, passed through
            return Response(last.body, status_code=last.status, media_type=last.content_type)
        return JSONResponse(
            error_body(f"backends {', '.join(tried)} failed: {last}", "server_error", code=502),
            status_code=502,
        )

    async def _open(
        self, b: Backend, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        assert self.session is not None, "start() the router first"
        resp = await self.session.post(b.url + path, data=body, headers=headers)
        try:
            if resp.status in BACKEND_DOWN_STATUSES:
                raw = await resp.read()
                raise AttemptFailed(
                    f"answered {resp.status}", resp.status, raw, resp.headers.get("content-type")
                )
            first = await resp.content.readany()
            if not first and resp.status == 200:
                raise AttemptFailed("closed the response before its first byte")
            return resp, first
        except BaseException:
            resp.close()
            raise

    async def _attempt(
        self,
        b: Backend,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        disconnected: Callable[[], Coroutine[Any, Any, None]] | None,
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """The response and its first bytes, or AttemptFailed (cancelled if the client left)."""
        task = asyncio.create_task(self._open(b, path, body, headers))
        down = asyncio.create_task(b.down.wait())
        gone = asyncio.create_task(disconnected()) if disconnected is not None else None
        waiters = {task, down} | ({gone} if gone is not None else set())
        returned = False
        try:
            done, _ = await asyncio.wait(
                waiters,
                timeout=self.config.request_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if task in done:
                try:
                    result = task.result()
                except AttemptFailed:
                    raise
                except Exception as e:
                    raise AttemptFailed(f"{type(e).__name__}: {e}") from e
                returned = True
                return result
            if gone is not None and gone in done:
                raise ClientGone("client disconnected while waiting for the backend")
            if down in done:
                raise AttemptFailed("ejected by the health checks while waiting")
            raise AttemptFailed(f"no response within {self.config.request_timeout_s} s")
        finally:
            for t in waiters:
                t.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            if not returned and task.done() and not task.cancelled() and not task.exception():
                task.result()[0].close()  # finished while being abandoned

    async def forward_get(self, path: str, headers: Mapping[str, str]) -> Response:
        """A GET (``/v1/models``) on a healthy serving backend; a second one if it fails."""
        assert self.session is not None, "start() the router first"
        fwd = {k: v for k, v in headers.items() if k.lower() in FORWARD_REQUEST_HEADERS}
        candidates = sorted(self.pool.healthy(SERVING_ROLES), key=lambda b: b.replica.load)
        errors = []
        for b in candidates[:2]:
            try:
                timeout = aiohttp.ClientTimeout(total=self.pool.health_timeout * 2)
                async with self.session.get(b.url + path, headers=fwd, timeout=timeout) as r:
                    raw = await r.read()
                    if r.status < 500:
                        return Response(
                            raw, status_code=r.status, media_type=r.headers.get("content-type")
                        )
                    errors.append(f"{b.id} answered {r.status}")
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                errors.append(f"{b.id}: {type(e).__name__}")
        if not candidates:
            return JSONResponse(
                error_body("no healthy backend", "server_error", code=503), status_code=503
            )
        return JSONResponse(
            error_body("; ".join(errors), "server_error", code=502), status_code=502
        )
