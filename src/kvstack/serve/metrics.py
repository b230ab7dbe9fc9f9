"""Prometheus metrics with the names of DESIGN.md (following vLLM's ``vllm:`` family).

Engine-level values (KV usage, queue lengths, prefix-cache counters) are read from the
latest ``EngineStats`` snapshot that the engine thread publishes after every step, so a
scrape never touches the engine. Latency histograms are observed as tokens arrive.
Operators scale on ``kvstack:kv_cache_usage_perc`` (it rises before the queue does)
and watch ``kvstack:num_requests_waiting``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvstack.kv.base import KVCacheStats
from kvstack.kv.tiers.base import LOAD_LATENCY_BUCKETS, TierStats
from kvstack.request import RequestOutput
from kvstack.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        s, kv, name = self.m.stats, self.m.kv, self.m.model_name
        if s is None or kv is None:
            return
        gauges = {
            "kv_cache_usage_perc": ("KV blocks held by requests or pins (0-1)", s.kv_usage),
            "num_requests_running": ("Requests in the running batch", s.num_running),
            "num_requests_waiting": ("Requests waiting for a first schedule", s.num_waiting),
            "kv_cache_num_blocks": ("KV blocks in the pool", kv.num_blocks),
            "kv_cache_free_blocks": ("KV blocks free or evictable", kv.num_free_blocks),
            "kv_cache_cached_blocks": ("KV blocks holding reusable prefixes", kv.num_cached_blocks),
            "kv_cache_pinned_blocks": ("KV blocks held by pins", kv.num_pinned_blocks),
            "kv_cache_waste_avg": ("Time-averaged reserved-but-unwritten KV share", s.kv_waste_avg),
            "kv_cache_capacity_tokens": (
                "Tokens the KV pool holds (codec included)",
                s.kv_capacity_tokens,
            ),
            "kv_cache_bytes_per_token": (
                "KV bytes per token, scales included",
                s.kv_bytes_per_token,
            ),
        }
        for key, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"kvstack:{key}", doc, labels=["model_name"])
            g.add_metric([name], float(value))
            yield g
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up", s.prefix_query_tokens),
            "prefix_cache_hits": ("Prompt tokens served from the cache", s.prefix_hit_tokens),
            "num_preemptions": ("Requests preempted (recompute)", s.num_preemptions),
            "evicted_blocks": ("Cached KV blocks evicted", s.num_evicted_blocks),
            "prefill_tokens_computed": ("Prompt tokens computed", s.prefill_tokens_computed),
            "reclaimed_blocks": ("KV blocks a press freed by compaction", s.num_reclaimed_blocks),
            "pressed_requests": ("Requests whose KV a press compacted", s.num_pressed_requests),
            "press_reapplied": ("Presses again while decoding (--kv-press-every)", s.num_represses),
            "press_dropped_tokens": ("Cached tokens presses removed", s.num_press_dropped_tokens),
        }
        for key, (doc, value) in counters.items():
            c = CounterMetricFamily(f"kvstack:{key}", doc, labels=["model_name"])
            c.add_metric([name], float(value))
            yield c
        skipped = CounterMetricFamily(
            "kvstack:press_skipped",
            "Presses left undone (the request stays unpressed), by reason",
            labels=["model_name", "reason"],
        )
        for reason, count in s.press_skipped.items():
            skipped.add_metric([name, reason], float(count))
        yield skipped
        fb = CounterMetricFamily(
            "kvstack:kernel_fallback",
            "Uses of the PyTorch path where a C++ kernel was meant to run",
            labels=["model_name", "kernel", "reason"],
        )
        for kernel, reason, count in s.kernel_fallbacks:
            fb.add_metric([name, kernel, reason], float(count))
        yield fb
        if s.offload:
            yield from _offload_metrics(name, s.offload)


_OFFLOAD_COUNTERS = {
    "offload_hits": ("KV blocks found in an offload tier", "hits"),
    "offload_misses": ("Tier lookups that stopped at a missing block", "misses"),
    "offload_stores": ("KV blocks written to an offload tier", "stores"),
    "offload_loaded_bytes": ("Bytes read from an offload tier", "bytes_loaded"),
    "offload_stored_bytes": ("Bytes written to an offload tier", "bytes_stored"),
    "offload_evictions": ("Blocks a tier dropped to stay in its budget", "evictions"),
    "offload_errors": ("Failed tier operations (I/O error, timeout, refused)", "errors"),
    "offload_corrupt_blocks": ("Stored blocks failing their checksum (recomputed)", "corrupt"),
    "offload_dropped_stores": ("Stores skipped (tier down or full, queue full)", "dropped_stores"),
}


def _offload_metrics(name: str, tiers: dict[str, TierStats]) -> Iterator[Metric]:
    """``kvstack:offload_*{tier=}`` from the per-tier counters (``kv/tiers/base.py``)."""
    labels = ["model_name", "tier"]
    for key, (doc, attr) in _OFFLOAD_COUNTERS.items():
        c = CounterMetricFamily(f"kvstack:{key}", doc, labels=labels)
        for tier, st in tiers.items():
            c.add_metric([name, tier], float(getattr(st, attr)))
        yield c
    loads = CounterMetricFamily(
        "kvstack:offload_loads", "Tier lookups that loaded at least one block", labels=labels
    )
    blocks = GaugeMetricFamily("kvstack:offload_blocks", "KV blocks held by a tier", labels=labels)
    used = GaugeMetricFamily("kvstack:offload_used_bytes", "Bytes held by a tier", labels=labels)
    hist = HistogramMetricFamily(
        "kvstack:offload_load_latency_seconds",
        "Time to load one request's run of blocks from a tier",
        labels=labels,
    )
    for tier, st in tiers.items():
        loads.add_metric([name, tier], float(sum(st.load_latency_counts)))
        blocks.add_metric([name, tier], float(st.num_blocks))
        used.add_metric([name, tier], float(st.used_bytes))
        cumulative, buckets = 0, []
        bounds = (*LOAD_LATENCY_BUCKETS, math.inf)
        for le, count in zip(bounds, st.load_latency_counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if le == math.inf else str(le), float(cumulative)))
        hist.add_metric([name, tier], buckets, st.load_latency_sum)
    yield from (loads, blocks, used, hist)


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.stats: EngineStats | None = None
        self.kv: KVCacheStats | None = None
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram(
            "kvstack:time_to_first_token_seconds", "Time to first token", labels,
            buckets=LATENCY_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.itl = Histogram(
            "kvstack:inter_token_latency_seconds", "Time between output tokens", labels,
            buckets=LATENCY_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.e2e = Histogram(
            "kvstack:e2e_request_latency_seconds", "Request latency, arrival to finish", labels,
            buckets=LATENCY_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.prompt_tokens = Counter(
            "kvstack:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "kvstack:generation_tokens", "Generated tokens of finished requests", labels, registry=r
        ).labels(model_name)
        self.request_success = Counter(
            "kvstack:request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.http_errors = Counter(
            "kvstack:http_errors", "Error responses by status", ["status"], registry=r
        )
        self.registry.register(_EngineCollector(self))

    def update_engine(self, stats: EngineStats, kv: KVCacheStats) -> None:
        self.stats, self.kv = stats, kv

    def on_finished(self, out: RequestOutput, e2e_s: float, reason: str) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        self.request_success.labels(self.model_name, reason).inc()
