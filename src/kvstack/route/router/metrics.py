"""The router's own Prometheus metrics (``kvstack_router:*``), in a private registry.

Counters are incremented on the request path; the per-backend gauges (``backend_healthy``,
``inflight``, ``load``) are read from the :class:`~kvstack.route.router.backends.BackendPool` at
scrape time, so a removed backend's series disappears with it. The prefix hit ratio the
router *expects* is ``matched_blocks_total / prompt_blocks_total`` (the engines'
``vllm:prefix_cache_*`` metrics give the real one).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstack.route.router.backends import BackendPool


class _PoolCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "kvstack_router:backend_healthy", "1 if the backend is in rotation", labels=["replica"]
        )
        inflight = GaugeMetricFamily(
            "kvstack_router:inflight",
            "Requests the router has open on the backend",
            labels=["replica"],
        )
        load = GaugeMetricFamily(
            "kvstack_router:load", "Backend load as the policy sees it", labels=["replica"]
        )
        for b in list(self.pool.backends.values()):
            healthy.add_metric([b.id], 1.0 if b.healthy else 0.0)
            inflight.add_metric([b.id], float(b.replica.inflight))
            load.add_metric([b.id], float(b.replica.load))
        yield healthy
        yield inflight
        yield load


class RouterMetrics:
    """Counters of one router; ``render()`` is the ``/metrics`` body."""

    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvstack_router:requests",
            "Routing decisions (retries and prefill steps included)",
            ["replica", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "kvstack_router:retries", "Requests retried on another backend", registry=r
        )
        self.backend_failures = Counter(
            "kvstack_router:backend_failures",
            "Attempts that failed before the first byte (refused, timed out, 5xx, ejected)",
            ["replica"],
            registry=r,
        )
        self.stream_errors = Counter(
            "kvstack_router:stream_errors",
            "Responses cut off after their first byte (no retry possible)",
            registry=r,
        )
        self.no_replica = Counter(
            "kvstack_router:no_replica", "Requests answered 503 for want of a backend", registry=r
        )
        self.matched_blocks = Counter(
            "kvstack_router:matched_blocks",
            "Prompt blocks the chosen backend was expected to hold",
            registry=r,
        )
        self.prompt_blocks = Counter(
            "kvstack_router:prompt_blocks", "Full prompt blocks of routed requests", registry=r
        )
        self.prefill_handoffs = Counter(
            "kvstack_router:prefill_handoffs",
            "Prefill steps that finished on a prefill backend before decode",
            registry=r,
        )
        self.prefill_failures = Counter(
            "kvstack_router:prefill_failures",
            "Prefill steps that failed or timed out (decode recomputes the prompt)",
            registry=r,
        )
        r.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def total(self, counter: Counter) -> float:
        """Sum of a counter over all its label sets."""
        return sum(
            s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")
        )
