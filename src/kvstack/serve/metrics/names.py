"""The one place that names a Prometheus family: vLLM's names where vLLM has the family.

A vLLM deployment switches to kvstack with no change to its Grafana dashboards, KEDA
ScaledObjects or llm-d / Gateway API Inference Extension scorers, which read
``vllm:kv_cache_usage_perc``, ``vllm:num_requests_waiting`` and the latency histograms.
So every family vLLM v1 exports (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``)
is exported under vLLM's name, type, unit, labels (``model_name`` and ``engine``) and
bucket boundaries (``vllm/v1/metrics/buckets.py``); kvstack's own families (block
counts, tiers, codecs, presses, kernel fallbacks, HTTP errors) keep the ``kvstack:``
prefix and the ``model_name`` label.

No ``kvstack:`` alias of a renamed family is exported: two names for one series double
the scrape and let a dashboard silently read the stale one. A new family is named here
(``metric_name``), so the prefix decision is never made twice.
"""

from __future__ import annotations

VLLM = "vllm:"
KVSTACK = "kvstack:"

#: Label names of every vLLM family (``engine`` is the engine index, "0" here).
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"

#: Families vLLM v1 has; everything else is ``kvstack:``. Counters without ``_total``:
#: the client library appends it on exposition, as vLLM's does.
VLLM_FAMILIES = frozenset(
    {
        # scheduler state
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_waiting_by_reason",
        "kv_cache_usage_perc",
        "cache_config_info",
        # counters
        "prefix_cache_queries",
        "prefix_cache_hits",
        "external_prefix_cache_queries",
        "external_prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "prompt_tokens_by_source",
        "prompt_tokens_cached",
        "prompt_tokens_cached_by_source",
        "generation_tokens",
        "request_success",
        "admission_rejections",
        # histograms
        "request_prompt_tokens",
        "request_generation_tokens",
        "iteration_tokens_total",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_num_preemptions",
        "request_prefill_kv_computed_tokens",
        # KV block residency (--kv-cache-metrics)
        "kv_block_lifetime_seconds",
        "kv_block_idle_before_evict_seconds",
        "kv_block_reuse_gap_seconds",
        # speculative decoding (``vllm/v1/spec_decode/metrics.py``, counters)
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    }
)

#: ``vllm:admission_rejections``'s ``reason`` values (vLLM's ``ADMISSION_REASONS``).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
#: ``vllm:num_requests_waiting_by_reason``'s ``reason`` values (vLLM's order).
WAITING_REASONS = ("capacity", "deferred")
#: ``vllm:prompt_tokens_by_source``'s ``source`` values (``PromptTokenStats.ALL_SOURCES``).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``vllm:prompt_tokens_cached_by_source``'s ``source`` values (``CacheHitSource``), and
#: where each kvstack tier counts: Redis is a remote store, vLLM's ``external_unspecified``.
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
TIER_HIT_SOURCE = {"device": "device", "host": "host", "disk": "disk",
                   "redis": "external_unspecified"}  # fmt: skip


def metric_name(family: str) -> str:
    """``vllm:family`` for a family vLLM has, ``kvstack:family`` otherwise."""
    return (VLLM if family in VLLM_FAMILIES else KVSTACK) + family


# Bucket boundaries, copied from vLLM's ``vllm/v1/metrics/buckets.py`` (same values, so a
# dashboard's histogram_quantile reads the same resolution on both engines).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
KV_CACHE_RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
    600, 1200, 1800,
)  # fmt: skip


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, ... <= the cap."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10
