"""The engine's snapshot as Prometheus families, read at scrape time (never the engine).

``AsyncEngine`` publishes an ``EngineStats`` + ``KVCacheStats`` snapshot after every
step; this collector turns the latest one into families: vLLM's (``vllm:`` with
``model_name`` and ``engine`` labels: queue lengths, the waiting ones by reason
(``deferred``: an offload-tier lookup in flight, vLLM's KV-transfer wait), KV usage,
prefix-cache counters, preemptions, ``cache_config_info``) and kvstack's own (``kvstack:`` with
``model_name``: block counts, waste, codec capacity, presses, tiers, kernel
fallbacks). Names come from ``serve/metrics/names.py`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvstack.engine.stats import EngineStats
from kvstack.kv.base import KVCacheStats
from kvstack.kv.tiers.base import LOAD_LATENCY_BUCKETS, TierStats
from kvstack.serve.metrics.names import ENGINE_INDEX, VLLM_LABELS, WAITING_REASONS, metric_name


class Snapshot(Protocol):
    """What the collector reads of ``Snapshot`` (``serve/metrics/server.py``): the
    latest engine snapshot, set by the engine thread and read here at scrape time."""

    @property
    def stats(self) -> EngineStats | None: ...
    @property
    def kv(self) -> KVCacheStats | None: ...
    @property
    def model_name(self) -> str: ...
    @property
    def cache_info(self) -> dict[str, str]: ...
    @property
    def kv_events_dropped(self) -> Callable[[], int]: ...


class EngineCollector(Collector):
    """Families of the latest engine snapshot of ``metrics`` (none before the first)."""

    def __init__(self, metrics: Snapshot) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        s, kv, name = self.m.stats, self.m.kv, self.m.model_name
        if s is None or kv is None:
            return
        vllm = [name, ENGINE_INDEX]
        vllm_gauges = {
            "kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
            "num_requests_running": ("Number of requests in model execution batches.",
                                     s.num_running),
            "num_requests_waiting": ("Number of requests waiting to be processed.",
                                     s.num_waiting),
        }  # fmt: skip
        for key, (doc, value) in vllm_gauges.items():
            g = GaugeMetricFamily(metric_name(key), doc, labels=VLLM_LABELS)
            g.add_metric(vllm, float(value))
            yield g
        by_reason = GaugeMetricFamily(
            metric_name("num_requests_waiting_by_reason"),
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA "
            "budget, KV transfer, blocked status). Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            labels=[*VLLM_LABELS, "reason"],
        )
        deferred = s.num_waiting_deferred
        for reason, n in zip(WAITING_REASONS, (s.num_waiting - deferred, deferred), strict=True):
            by_reason.add_metric([*vllm, reason], float(n))
        yield by_reason
        vllm_counters = {
            "prefix_cache_queries": ("Prefix cache queries, in terms of number of queried "
                                     "tokens.", s.prefix_query_tokens),
            "prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.",
                                  s.prefix_hit_tokens),
            "num_preemptions": ("Cumulative number of preemption from the engine.",
                                s.num_preemptions),
        }  # fmt: skip
        for key, (doc, value) in vllm_counters.items():
            c = CounterMetricFamily(metric_name(key), doc, labels=VLLM_LABELS)
            c.add_metric(vllm, float(value))
            yield c
        yield _info(self.m.cache_info)
        if s.spec_decode:
            yield from _spec_decode_metrics(vllm, s.spec_decode)
        yield from _own_metrics(self.m, name)
        if s.segments:
            yield from _segment_metrics(name, s.segments)
        if s.offload:
            yield from _offload_metrics(name, s.offload)


def _spec_decode_metrics(vllm: list[str], spec: Mapping[str, Any]) -> Iterator[Metric]:
    """vLLM's ``SpecDecodingProm`` counters (only with ``--speculative-config``, as vLLM):
    labels ``model_name``, ``engine``; per position also ``position`` ("0" .. k - 1)."""
    for key, field, doc in (
        ("spec_decode_num_drafts", "num_drafts", "Number of spec decoding drafts."),
        ("spec_decode_num_draft_tokens", "num_draft_tokens", "Number of draft tokens."),
        ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Number of accepted tokens."),
    ):
        c = CounterMetricFamily(metric_name(key), doc, labels=VLLM_LABELS)
        c.add_metric(vllm, float(spec[field]))
        yield c
    per_pos = CounterMetricFamily(
        metric_name("spec_decode_num_accepted_tokens_per_pos"),
        "Accepted tokens per draft position.",
        labels=[*VLLM_LABELS, "position"],
    )
    for pos, count in enumerate(spec["accepted_per_pos"]):
        per_pos.add_metric([*vllm, str(pos)], float(count))
    yield per_pos


def _segment_metrics(name: str, seg: Mapping[str, int]) -> Iterator[Metric]:
    """Segment reuse, in tokens: like ``vllm:prefix_cache_*`` for segments."""
    for key, field, doc in (
        ("segment_cache_queries", "query_tokens", "Segment cache queries, in tokens."),
        ("segment_cache_hits", "hit_tokens", "Segment cache hits, in tokens."),
        ("segment_recomputed_tokens", "recomputed_tokens",
         "Tokens of placed segments recomputed (repair)."),
        ("segment_computed_tokens", "computed_tokens",
         "Tokens computed standalone into the segment cache (with the sink)."),
        ("segment_placed_tokens", "placed_tokens", "Prompt tokens copied from segments."),
        ("segment_loaded_tokens", "loaded_tokens",
         "Segment tokens loaded from an offload tier instead of computed."),
    ):  # fmt: skip
        c = CounterMetricFamily(metric_name(key), doc, labels=["model_name"])
        c.add_metric([name], float(seg[field]))
        yield c


def _info(cache_info: Mapping[str, str]) -> Metric:
    """vLLM's ``cache_config_info``: a gauge at 1 whose labels are the cache config."""
    labels = {**cache_info, "engine": ENGINE_INDEX}
    g = GaugeMetricFamily(
        metric_name("cache_config_info"),
        "Information of the LLMEngine CacheConfig",
        labels=list(labels),
    )
    g.add_metric(list(labels.values()), 1.0)
    return g


def _own_metrics(m: Snapshot, name: str) -> Iterator[Metric]:
    s, kv = m.stats, m.kv
    assert s is not None and kv is not None
    gauges = {
        "kv_cache_num_blocks": ("KV blocks in the pool", kv.num_blocks),
        "kv_cache_free_blocks": ("KV blocks free or evictable", kv.num_free_blocks),
        "kv_cache_cached_blocks": ("KV blocks holding reusable prefixes", kv.num_cached_blocks),
        "kv_cache_pinned_blocks": ("KV blocks held by pins", kv.num_pinned_blocks),
        "kv_cache_waste_avg": ("Time-averaged reserved-but-unwritten KV share", s.kv_waste_avg),
        "kv_cache_capacity_tokens": ("Tokens the KV pool holds (codec included)",
                                     s.kv_capacity_tokens),
        "kv_cache_bytes_per_token": ("KV bytes per token, scales included",
                                     s.kv_bytes_per_token),
    }  # fmt: skip
    for key, (doc, value) in gauges.items():
        g = GaugeMetricFamily(metric_name(key), doc, labels=["model_name"])
        g.add_metric([name], float(value))
        yield g
    counters = {
        "evicted_blocks": ("Cached KV blocks evicted", s.num_evicted_blocks),
        "prefill_tokens_computed": ("Prompt tokens computed", s.prefill_tokens_computed),
        "reclaimed_blocks": ("KV blocks a press freed by compaction", s.num_reclaimed_blocks),
        "pressed_requests": ("Requests whose KV a press compacted", s.num_pressed_requests),
        "press_reapplied": ("Presses again while decoding (--kv-press-every)", s.num_represses),
        "press_dropped_tokens": ("Cached tokens presses removed", s.num_press_dropped_tokens),
        "press_input_tokens": ("Cached tokens presses ranked", s.num_press_input_tokens),
    }
    for key, (doc, value) in counters.items():
        c = CounterMetricFamily(metric_name(key), doc, labels=["model_name"])
        c.add_metric([name], float(value))
        yield c
    skipped = CounterMetricFamily(
        metric_name("press_skipped"),
        "Presses left undone (the request stays unpressed), by reason",
        labels=["model_name", "reason"],
    )
    for reason, count in s.press_skipped.items():
        skipped.add_metric([name, reason], float(count))
    yield skipped
    fb = CounterMetricFamily(
        metric_name("kernel_fallback"),
        "Uses of the PyTorch path where a C++ kernel was meant to run",
        labels=["model_name", "kernel", "reason"],
    )
    for kernel, reason, count in s.kernel_fallbacks:
        fb.add_metric([name, kernel, reason], float(count))
    yield fb
    for key, doc in (("kv_events_dropped", "KV events dropped: a ZMQ subscriber too slow "
                      "(the publisher's bounded queue was full)"),):  # fmt: skip
        c = CounterMetricFamily(metric_name(key), doc, labels=["model_name"])
        c.add_metric([name], float(m.kv_events_dropped()))
        yield c


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
        c = CounterMetricFamily(metric_name(key), doc, labels=labels)
        for tier, st in tiers.items():
            c.add_metric([name, tier], float(getattr(st, attr)))
        yield c
    loads = CounterMetricFamily(
        metric_name("offload_loads"), "Tier lookups that loaded at least one block", labels=labels
    )
    blocks = GaugeMetricFamily(
        metric_name("offload_blocks"), "KV blocks held by a tier", labels=labels
    )
    used = GaugeMetricFamily(
        metric_name("offload_used_bytes"), "Bytes held by a tier", labels=labels
    )
    hist = HistogramMetricFamily(
        metric_name("offload_load_latency_seconds"),
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
