"""Prometheus metrics under vLLM's names (``serve/metrics/names.py``), one registry per server.

Engine-level values (KV usage, queue lengths, prefix-cache counters) are read from the
latest ``EngineStats`` snapshot that the engine thread publishes after every step
(``serve/metrics/engine.py``), so a scrape never touches the engine. Per-request
families are observed on the engine thread as tokens arrive and as requests finish,
with vLLM v1's definitions (``vllm/v1/metrics/stats.py``):

* queue time = first scheduled - arrival; prefill time = first token - first scheduled;
  decode time = last token - first token; inference time = last token - first
  scheduled; time per output token = decode time / (output tokens - 1);
* ``prompt_tokens`` counts a request's prompt, and ``prompt_tokens_cached`` its cached
  part (device + tiers), when its first token arrives; ``generation_tokens`` each token;
* ``external_prefix_cache_{queries,hits}``: with offload tiers, the prompt's tokens and
  the part the tiers supplied (vLLM's KV-connector counters); 0 without tiers;
* ``prompt_tokens_by_source``: the prompt split into ``local_compute`` (computed),
  ``local_cache_hit`` (the device prefix cache) and ``external_kv_transfer`` (offload
  tiers), so the three sum to ``prompt_tokens``; ``prompt_tokens_cached_by_source``:
  the cached part by vLLM's ``CacheHitSource`` (``device``, ``host``, ``disk``; Redis
  is ``external_unspecified``; kvstack has no ``p2p``). Both at the first token, with
  ``prompt_tokens`` (vLLM counts the second at admission: a preempted request's
  re-admission hits count there, not here);
* ``admission_rejections{reason}`` (labels ``model_name`` and ``reason`` only, as
  vLLM's): ``max_num_queued_reqs`` counts the 429s of ``--max-waiting``;
  ``max_num_queued_tokens`` stays 0 (kvstack has no queued-token limit);
* ``kv_block_{lifetime,idle_before_evict,reuse_gap}_seconds`` (``--kv-cache-metrics``
  only, as in vLLM): the engine's ``kv/residency.py`` samples, drained after each step.

Operators scale on ``vllm:kv_cache_usage_perc`` (it rises before the queue does) and
``vllm:num_requests_waiting``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvstack.core.request import RequestOutput
from kvstack.engine.stats import EngineStats
from kvstack.kv.base import KVCacheStats
from kvstack.kv.residency import ResidencySample
from kvstack.serve.metrics.engine import EngineCollector
from kvstack.serve.metrics.names import (
    ADMISSION_REASONS,
    CACHE_HIT_SOURCES,
    ENGINE_INDEX,
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    KV_CACHE_RESIDENCY_BUCKETS,
    PROMPT_TOKEN_SOURCES,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIER_HIT_SOURCE,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    VLLM_LABELS,
    metric_name,
    request_tokens_buckets,
)
from kvstack.serve.output_stream import RequestInfo

FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values


def _histograms(max_model_len: int) -> list[tuple[str, str, Sequence[float]]]:
    """(family, vLLM's documentation, vLLM's buckets) of every per-request histogram."""
    lat, tokens = REQUEST_LATENCY_BUCKETS, request_tokens_buckets(max_model_len)
    itl = INTER_TOKEN_LATENCY_BUCKETS
    return [
        ("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         TIME_TO_FIRST_TOKEN_BUCKETS),
        ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl),
        ("request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.", itl),
        ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat),
        ("request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", lat),
        ("request_inference_time_seconds",
         "Histogram of time spent in RUNNING phase for request.", lat),
        ("request_prefill_time_seconds",
         "Histogram of time spent in PREFILL phase for request.", lat),
        ("request_decode_time_seconds",
         "Histogram of time spent in DECODE phase for request.", lat),
        ("request_prompt_tokens", "Number of prefill tokens processed.", tokens),
        ("request_generation_tokens", "Number of generation tokens processed.", tokens),
        ("request_prefill_kv_computed_tokens",
         "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens),
        ("request_max_num_generation_tokens",
         "Histogram of maximum number of requested generation tokens.", tokens),
        ("request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
        ("request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens),
        ("request_num_preemptions", "Number of preemptions per finished request.",
         REQUEST_NUM_PREEMPTIONS_BUCKETS),
        ("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
         ITERATION_TOKENS_BUCKETS),
    ]  # fmt: skip


def _residency_histograms(r: CollectorRegistry, values: Sequence[str]) -> tuple[Any, Any, Any]:
    """vLLM's three ``--kv-cache-metrics`` histograms (names, docs and buckets as vLLM's)."""
    sampled = "Sampled metrics (controlled by --kv-cache-metrics-sample)."
    docs = {
        "kv_block_lifetime_seconds": "Histogram of KV cache block lifetime from allocation "
        f"to eviction. {sampled}",
        "kv_block_idle_before_evict_seconds": "Histogram of idle time before KV cache block "
        f"eviction. {sampled}",
        "kv_block_reuse_gap_seconds": "Histogram of time gaps between consecutive KV cache "
        f"block accesses. Only the most recent accesses are recorded (ring buffer). {sampled}",
    }
    lifetime, idle, gap = (
        Histogram(metric_name(k), doc, list(VLLM_LABELS), buckets=KV_CACHE_RESIDENCY_BUCKETS,
                  registry=r).labels(*values)
        for k, doc in docs.items()
    )  # fmt: skip
    return lifetime, idle, gap


class ServerMetrics:
    """One registry per server (tests run several in one process).

    ``cache_info`` becomes the labels of ``vllm:cache_config_info``; ``max_model_len``
    caps the token-count buckets as vLLM's do.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int = 8192,
        cache_info: Mapping[str, str] | None = None,
        kv_cache_metrics: bool = False,
    ) -> None:
        self.model_name = model_name
        self.cache_info = dict(cache_info or {})
        self.registry = CollectorRegistry()
        self.stats: EngineStats | None = None
        self.kv: KVCacheStats | None = None
        #: Drops of the ZMQ KV-event publisher (set by the server that starts one).
        self.kv_events_dropped: Callable[[], int] = lambda: 0
        r, labels, values = self.registry, list(VLLM_LABELS), (model_name, ENGINE_INDEX)

        def hist(key: str, doc: str, buckets: Sequence[float]) -> Histogram:
            h = Histogram(metric_name(key), doc, labels, buckets=buckets, registry=r)
            return h.labels(*values)

        def counter(key: str, doc: str) -> Counter:
            return Counter(metric_name(key), doc, labels, registry=r).labels(*values)

        h = {key: hist(key, doc, b) for key, doc, b in _histograms(max_model_len)}
        self.ttft = h["time_to_first_token_seconds"]
        self.itl = h["inter_token_latency_seconds"]
        self.tpot = h["request_time_per_output_token_seconds"]
        self.e2e = h["e2e_request_latency_seconds"]
        self.queue = h["request_queue_time_seconds"]
        self.inference = h["request_inference_time_seconds"]
        self.prefill = h["request_prefill_time_seconds"]
        self.decode = h["request_decode_time_seconds"]
        self.req_prompt = h["request_prompt_tokens"]
        self.req_generation = h["request_generation_tokens"]
        self.req_computed = h["request_prefill_kv_computed_tokens"]
        self.req_max_gen = h["request_max_num_generation_tokens"]
        self.req_n = h["request_params_n"]
        self.req_max_tokens = h["request_params_max_tokens"]
        self.req_preemptions = h["request_num_preemptions"]
        self.iteration = h["iteration_tokens_total"]
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_cached = counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self.ext_queries = counter(
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.ext_hits = counter(
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        by_source = Counter(
            metric_name("prompt_tokens_by_source"), "Number of prompt tokens by source.",
            [*labels, "source"], registry=r,
        )  # fmt: skip
        self.prompt_by_source = {k: by_source.labels(*values, k) for k in PROMPT_TOKEN_SOURCES}
        cached_by = Counter(
            metric_name("prompt_tokens_cached_by_source"),
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local "
            "HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM "
            "instance) or external_unspecified. Counted at admission; sums to "
            "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            [*labels, "source"], registry=r,
        )  # fmt: skip
        self.cached_by_source = {k: cached_by.labels(*values, k) for k in CACHE_HIT_SOURCES}
        self.residency = _residency_histograms(r, values) if kv_cache_metrics else None
        rejections = Counter(
            metric_name("admission_rejections"),
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"], registry=r,
        )  # fmt: skip
        # --max-waiting is vLLM's max_num_queued_reqs; kvstack has no token limit (0).
        self.admission_rejections = {k: rejections.labels(model_name, k) for k in ADMISSION_REASONS}
        success = Counter(
            metric_name("request_success"), "Count of successfully processed requests.",
            [*labels, "finished_reason"], registry=r,
        )  # fmt: skip
        self.request_success = {fr: success.labels(*values, fr) for fr in FINISH_REASONS}
        self.http_errors = Counter(
            metric_name("http_errors"), "Error responses by status", ["status"], registry=r
        )
        # Bugs, never bad input (that is a 4xx): an exception no handler expected (a 500
        # with its traceback in the log) or a failed engine step. The fuzz keeps it at 0.
        self.internal_errors = Counter(
            metric_name("internal_errors"),
            "Internal errors (unhandled exception, failed step)",
            ["where"], registry=r,
        )  # fmt: skip
        self.registry.register(EngineCollector(self))

    def update_engine(self, stats: EngineStats, kv: KVCacheStats) -> None:
        self.stats, self.kv = stats, kv

    def on_residency(self, samples: Sequence[ResidencySample]) -> None:
        """Block residency samples the engine drained after a step (``--kv-cache-metrics``)."""
        if self.residency is None:
            return
        lifetime, idle, gap = self.residency
        for sample in samples:
            lifetime.observe(sample.lifetime_s)
            idle.observe(sample.idle_s)
            for g in sample.reuse_gaps_s:
                gap.observe(g)

    def on_step(self, num_tokens: int) -> None:
        """One engine step ran ``num_tokens`` (prefill chunks + decodes)."""
        if num_tokens > 0:
            self.iteration.observe(num_tokens)

    def on_tokens(self, out: RequestOutput, info: RequestInfo, new: int, now: float) -> None:
        """``new`` output tokens of ``out`` arrived at ``now`` (before ``info`` is updated)."""
        if new <= 0:
            return
        self.generation_tokens.inc(new)
        if info.first_token is None:
            self.ttft.observe(now - info.arrival)
            n_prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
            self.prompt_tokens.inc(n_prompt)
            self.prompt_cached.inc(cached)
            tiers = out.cached_tokens_by_tier or {"device": cached}
            external = sum(n for t, n in tiers.items() if t != "device")
            if out.cached_tokens_by_tier is not None:
                self.ext_queries.inc(n_prompt)
                self.ext_hits.inc(external)
            self.prompt_by_source["local_compute"].inc(max(0, n_prompt - cached))
            self.prompt_by_source["local_cache_hit"].inc(cached - external)
            self.prompt_by_source["external_kv_transfer"].inc(external)
            for tier, n in tiers.items():
                self.cached_by_source[TIER_HIT_SOURCE.get(tier, "external_unspecified")].inc(n)
        elif info.last_token is not None:
            self.itl.observe(now - info.last_token)

    def on_finished(self, out: RequestOutput, info: RequestInfo, now: float, reason: str) -> None:
        """Per-request histograms of a finished request (``now``: its last output)."""
        self.e2e.observe(now - info.arrival)
        n_out = sum(len(c.token_ids) for c in out.outputs)
        n_prompt = len(out.prompt_token_ids)
        self.req_prompt.observe(n_prompt)
        self.req_generation.observe(n_out)
        self.req_computed.observe(max(0, n_prompt - out.num_cached_tokens))
        if info.params is not None:
            self.req_n.observe(info.params.n)
            if info.params.max_tokens is not None:
                self.req_max_tokens.observe(info.params.max_tokens)
                self.req_max_gen.observe(info.params.max_tokens)
        self.request_success.get(reason, self.request_success["error"]).inc()
        m = out.metrics
        if m is None or m.first_scheduled_time is None:
            return
        self.req_preemptions.observe(m.num_preemptions)
        self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        last = info.last_token if info.last_token is not None else now
        self.inference.observe(max(0.0, last - m.first_scheduled_time))
        if m.first_token_time is not None:
            self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
            decode = max(0.0, last - m.first_token_time)
            self.decode.observe(decode)
            if n_out > 1:
                self.tpot.observe(decode / (n_out - 1))
