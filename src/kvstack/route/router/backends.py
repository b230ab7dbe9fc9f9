"""The router's backends: who they are, whether they are healthy, and how loaded.

A :class:`BackendPool` maps each backend URL (``http://host:port``, also the policy's
``Replica.id``) to a :class:`Backend` and runs, per backend, a health loop: every
``health_interval`` seconds ``GET /health`` then ``GET /load`` (each bounded by
``health_timeout``). ``fail_threshold`` consecutive failures *eject* a backend
(``healthy=False``: no policy routes to it); one success readmits it. The request path
reports its own failures (:meth:`BackendPool.report_failure`), which count the same way and
wake the health loop for an immediate recheck, so a dead replica leaves the pool within
milliseconds of the first refused request. This is Envoy's outlier detection and the
health checking of SGLang's / llm-d's routers, kept deliberately small: the router never
starts, stops or replaces replicas (Kubernetes and Ray Serve do).

``/load`` also teaches the pool each backend's ``role`` (prefill / decode / both) and the
``block_size`` and ``model_id`` that the KV-aware policies need to hash prompts the way
the engines do: the first backend to answer fixes them, and a backend that disagrees is
kept out of the pool (logged) since its cache could never match. A vLLM backend has no
``/load`` (404): its load comes from vLLM's ``/metrics`` (``vllm_load.py``).

``discover_dns="svc:8000"`` adds and removes backends as a name's A/AAAA records change
(``discovery.DnsDiscovery``; a Kubernetes headless Service). With event feeds
(:meth:`follow_events`), every backend also gets an ``event_sources.EventSource``: its
SSE stream, or its ZMQ publisher where the feeds know an endpoint for it.

Invariants (:meth:`check_integrity`): ``backends[url].replica.id == url``; ``healthy`` iff
its ``down`` event is clear; a healthy backend has fewer than ``fail_threshold``
consecutive failures and no model mismatch; with event feeds every backend has a
follower. Not thread-safe: one event loop owns the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvstack.core.errors import ConfigError
from kvstack.route.policy import Replica
from kvstack.route.router.discovery import (
    MAX_DISCOVERED,
    DnsDiscovery,
    Network,
    Resolver,
    normalize_url,
)
from kvstack.route.router.event_sources import EventFeeds, EventSource
from kvstack.route.router.vllm_load import load_from_metrics
from kvstack.serve.server import ROLES

logger = logging.getLogger("kvstack.route")

_STATE_FIELDS = ("url", "role", "source", "consecutive_failures", "failures_total", "ejections",
                 "last_error", "last_check", "block_size", "model_id", "served_model_name",
                 "mismatch")  # fmt: skip


@dataclass(frozen=True)
class LoadReport:
    """A backend's ``GET /load``, validated (``ValueError`` on a malformed one)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    role: str = "both"
    block_size: int | None = None
    model_id: str | None = None
    served_model_name: str | None = None

    @classmethod
    def parse(cls, data: Any) -> LoadReport:
        if not isinstance(data, dict):
            raise ValueError("/load is not a JSON object")
        try:
            running = int(data.get("num_requests_running") or 0)
            waiting = int(data.get("num_requests_waiting") or 0)
            kv_usage = float(data.get("kv_cache_usage_perc") or 0.0)
        except (TypeError, ValueError) as e:
            raise ValueError(f"/load has a malformed number: {e}") from None
        role = data.get("role", "both")
        if role not in ROLES:
            raise ValueError(f"/load reports unknown role {role!r}")
        block_size, model_id = data.get("block_size"), data.get("model_id")
        if not isinstance(block_size, int) or block_size < 1 or not isinstance(model_id, str):
            block_size, model_id = None, None  # unknown: the pool cannot learn from it
        name = data.get("served_model_name")
        return cls(running, waiting, kv_usage, role, block_size, model_id,
                   name if isinstance(name, str) else None)  # fmt: skip


@dataclass
class Backend:
    """One backend: its policy record plus what the health loop learned about it."""

    url: str
    replica: Replica
    source: str = "static"  # "static" (--backend) or "dns" (--discover-dns)
    role: str = "both"
    block_size: int | None = None
    model_id: str | None = None
    served_model_name: str | None = None
    admitted: bool = False  # has been healthy at least once
    consecutive_failures: int = 0
    failures_total: int = 0
    ejections: int = 0
    last_error: str | None = None
    last_check: float | None = None  # time.time() of the last completed check
    mismatch: str | None = None
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set while not healthy
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # recheck now
    follower: EventSource | None = None
    task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.replica.id

    @property
    def healthy(self) -> bool:
        return self.replica.healthy


class BackendPool:
    """The set of backends and their health/load loops (see the module docstring)."""

    def __init__(
        self,
        urls: Iterable[str] = (),
        *,
        health_interval: float = 2.0,
        health_timeout: float = 2.0,
        fail_threshold: int = 2,
        discover_dns: str | None = None,
        dns_interval: float = 5.0,
        api_key: str | None = None,
        resolver: Resolver | None = None,
        events_idle_timeout: float | None = 30.0,
        discover_allow: Sequence[Network] = (),
        max_discovered: int = MAX_DISCOVERED,
    ) -> None:
        if not health_interval > 0 or not health_timeout > 0:
            raise ConfigError("health interval and timeout must be > 0")
        if fail_threshold < 1:
            raise ConfigError(f"fail threshold must be >= 1, got {fail_threshold}")
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.fail_threshold = fail_threshold
        self.discovery: DnsDiscovery | None = None
        if discover_dns:
            self.discovery = DnsDiscovery(
                discover_dns, self.sync_discovered, interval=dns_interval, resolver=resolver,
                allow=discover_allow, max_backends=max_discovered,
            )  # fmt: skip
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # The server sends a keep-alive comment every 5 s: a longer silence is a hung stream.
        self.events_idle_timeout = events_idle_timeout
        self.backends: dict[str, Backend] = {}
        self.block_size: int | None = None
        self.model_id: str | None = None
        self.feeds: EventFeeds | None = None
        self.on_model_info: list[Callable[[int, str], None]] = []
        self.on_ejected: list[Callable[[str], None]] = []
        self.on_removed: list[Callable[[str], None]] = []
        self.session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[None]] = set()
        for url in urls:
            self.add(url)

    # -- membership ------------------------------------------------------------------------

    def add(self, url: str, source: str = "static") -> Backend:
        """Add a backend (unhealthy until its first check passes); idempotent."""
        url = normalize_url(url)
        if url in self.backends:
            return self.backends[url]
        b = Backend(url, Replica(url, healthy=False), source=source)
        b.down.set()
        self.backends[url] = b
        logger.info("backend %s added (%s)", url, source)
        if self.session is not None:
            self._start_backend(b)
        return b

    async def remove(self, url: str) -> None:
        """Stop checking ``url``, stop its follower and tell the policy to forget it."""
        b = self.backends.pop(url, None)
        if b is None:
            return
        b.replica.healthy = False
        b.down.set()
        await self._stop_backend(b)
        logger.info("backend %s removed (%s)", url, b.source)
        for cb in self.on_removed:
            cb(url)

    def get(self, replica_id: str) -> Backend | None:
        return self.backends.get(replica_id)

    def replicas(self, roles: Container[str] | None = None) -> list[Replica]:
        """The policy records of all backends (healthy or not), optionally by role."""
        return [b.replica for b in self.backends.values() if roles is None or b.role in roles]

    def healthy(self, roles: Container[str] | None = None) -> list[Backend]:
        return [
            b for b in self.backends.values() if b.healthy and (roles is None or b.role in roles)
        ]

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every backend's health loop (and follower) and the DNS loop."""
        if self.session is not None:
            return
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        for b in self.backends.values():
            self._start_backend(b)
        if self.discovery is not None:
            self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        for task in list(self._background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for b in list(self.backends.values()):
            await self._stop_backend(b)
            b.follower = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    def follow_events(self, feeds: EventFeeds) -> None:
        """Feed the policy's indexes from every backend's events (now and when added)."""
        self.feeds = feeds
        if self.session is not None:
            for b in self.backends.values():
                self._start_follower(b)

    def _start_follower(self, b: Backend) -> None:
        if self.feeds is None:
            return
        if b.follower is None:
            b.follower = self.feeds.source(
                b.url, self.session, self.headers, self.events_idle_timeout
            )
        b.follower.start()

    def _start_backend(self, b: Backend) -> None:
        if b.task is None or b.task.done():
            b.task = asyncio.create_task(self._health_loop(b), name=f"health:{b.url}")
        self._start_follower(b)

    async def _stop_backend(self, b: Backend) -> None:
        if b.task is not None:
            b.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await b.task
            b.task = None
        if b.follower is not None:
            await b.follower.stop()

    # -- health ----------------------------------------------------------------------------

    async def _health_loop(self, b: Backend) -> None:
        while True:
            b.wake.clear()
            try:
                await self.check(b)
            except Exception:  # a bug in a callback must not end health checking
                logger.exception("health check of %s failed unexpectedly", b.url)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(b.wake.wait(), self.health_interval)

    async def check(self, b: Backend) -> bool:
        """One ``/health`` + ``/load`` round for ``b``; True if it passed. Never raises."""
        assert self.session is not None, "start() the pool first"
        timeout = aiohttp.ClientTimeout(total=self.health_timeout)
        try:
            async with self.session.get(b.url + "/health", timeout=timeout) as r:
                await r.read()
                if r.status != 200:
                    raise ConnectionError(f"/health answered {r.status}")
            async with self.session.get(
                b.url + "/load", timeout=timeout, headers=self.headers
            ) as r:
                load = await r.json(content_type=None) if r.status == 200 else None
                if r.status not in (200, 404):  # 404: a server without /load (role both)
                    raise ConnectionError(f"/load answered {r.status}")
            report = None if load is None else LoadReport.parse(load)
            if load is None:  # vLLM: no /load; its /metrics has the same numbers
                async with self.session.get(b.url + "/metrics", timeout=timeout) as r:
                    found = load_from_metrics(await r.text()) if r.status == 200 else None
                report = None if found is None else LoadReport(*found)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self._failed(b, reason, "health check")
            return False
        self._passed(b, report)
        return True

    def report_failure(self, replica_id: str, error: str) -> None:
        """A request to ``replica_id`` failed before answering: count it, recheck now."""
        b = self.backends.get(replica_id)
        if b is not None:
            self._failed(b, error, "request")
            b.wake.set()

    def _failed(self, b: Backend, reason: str, what: str) -> None:
        b.consecutive_failures += 1
        b.failures_total += 1
        b.last_error = reason
        b.last_check = time.time()
        if not b.admitted:
            if b.consecutive_failures == 1:
                logger.warning("backend %s not reachable yet (%s)", b.url, reason)
            return
        if b.healthy and b.consecutive_failures >= self.fail_threshold:
            self._eject(b, f"{b.consecutive_failures} consecutive failures, last {what}: {reason}")

    def _eject(self, b: Backend, why: str) -> None:
        b.replica.healthy = False
        b.down.set()
        b.ejections += 1
        logger.warning("backend %s ejected: %s", b.url, why)
        for cb in self.on_ejected:
            cb(b.id)
        if b.follower is not None and b.follower.running:
            # A hung replica's stream may stay open and silent: resync on readmission.
            task = asyncio.get_running_loop().create_task(b.follower.restart())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _passed(self, b: Backend, load: LoadReport | None) -> None:
        b.consecutive_failures = 0
        b.last_error = None
        b.last_check = time.time()
        if load is not None:
            self._apply_load(b, load)
        if b.mismatch is not None:
            if b.healthy:
                self._eject(b, b.mismatch)
            return
        if not b.healthy:
            b.replica.healthy = True
            b.down.clear()
            if b.admitted:
                logger.info("backend %s readmitted (role %s)", b.url, b.role)
            else:
                logger.info("backend %s healthy (role %s)", b.url, b.role)
            b.admitted = True

    def _apply_load(self, b: Backend, load: LoadReport) -> None:
        r = b.replica
        r.running, r.waiting, r.kv_usage = load.running, load.waiting, load.kv_usage
        if load.role != b.role and b.admitted:
            logger.info("backend %s role %s -> %s", b.url, b.role, load.role)
        b.role = load.role
        b.served_model_name = load.served_model_name or b.served_model_name
        block_size, model_id = load.block_size, load.model_id
        if block_size is None or model_id is None:
            return
        b.block_size, b.model_id = block_size, model_id
        if self.block_size is None:
            self.block_size, self.model_id = block_size, model_id
            logger.info("learned block_size=%d model_id=%r from %s", block_size, model_id, b.url)
            for cb in self.on_model_info:
                cb(block_size, model_id)
        mismatch = None
        if (block_size, model_id) != (self.block_size, self.model_id):
            mismatch = (
                f"serves block_size={block_size} model_id={model_id!r}, but the pool has "
                f"block_size={self.block_size} model_id={self.model_id!r}"
            )
        if mismatch != b.mismatch:
            if mismatch is not None:
                logger.warning("backend %s rejected: %s", b.url, mismatch)
            else:
                logger.info("backend %s now matches the pool's model", b.url)
            b.mismatch = mismatch

    # -- discovery -------------------------------------------------------------------------

    async def sync_discovered(self, urls: set[str]) -> None:
        """Make the DNS-sourced backends exactly ``urls`` (static ones are kept)."""
        wanted = {normalize_url(u) for u in urls}
        for url in wanted - set(self.backends):
            self.add(url, source="dns")
        for url, b in list(self.backends.items()):
            if b.source == "dns" and url not in wanted:
                await self.remove(url)

    # -- introspection ---------------------------------------------------------------------

    def state(self) -> list[dict[str, Any]]:
        """Each backend as JSON for ``GET /router/state``."""
        out = []
        for b in self.backends.values():
            r = b.replica
            row = {k: getattr(b, k) for k in _STATE_FIELDS}
            row.update(id=b.id, healthy=r.healthy, load=r.load, inflight=r.inflight,
                       running=r.running, waiting=r.waiting, kv_usage=r.kv_usage)  # fmt: skip
            row["events"] = None if b.follower is None else b.follower.state()
            out.append(row)
        return out

    def check_integrity(self) -> None:
        for url, b in self.backends.items():
            assert b.url == url == b.replica.id, f"backend key {url} != {b.replica.id}"
            assert b.healthy != b.down.is_set(), f"{url}: healthy and down disagree"
            assert b.role in ROLES, f"{url}: role {b.role!r}"
            assert b.replica.inflight >= 0, f"{url}: inflight {b.replica.inflight}"
            if b.healthy:
                assert b.admitted and b.mismatch is None, f"{url}: healthy but not admitted"
                assert b.consecutive_failures < self.fail_threshold, f"{url}: should be ejected"
            if self.feeds is not None and self.session is not None:
                assert b.follower is not None, f"{url}: no event follower"
