"""``/metrics`` under vLLM v1's names, types, labels and buckets (``serve/metrics/names.py``).

The reference below is vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``)
and ``vllm/v1/metrics/buckets.py``, written out by hand: a dashboard, a KEDA trigger or
an llm-d scorer written for vLLM reads these exact series.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvstack.config.engine import EngineConfig
from kvstack.serve.metrics.names import VLLM_FAMILIES, metric_name, request_tokens_buckets
from kvstack.serve.server import ServerOptions, build_server
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

MAX_LEN = 256
# family (without vllm:) -> type, as vLLM declares it.
VLLM_TYPES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge", "cache_config_info": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "external_prefix_cache_queries": "counter", "external_prefix_cache_hits": "counter",
    "num_preemptions": "counter", "prompt_tokens": "counter",
    "prompt_tokens_cached": "counter", "generation_tokens": "counter",
    "request_success": "counter",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram", "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram", "request_params_max_tokens": "histogram",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "request_num_preemptions": "histogram",
    "request_prefill_kv_computed_tokens": "histogram",
    "num_requests_waiting_by_reason": "gauge", "prompt_tokens_by_source": "counter",
    "prompt_tokens_cached_by_source": "counter",
    "kv_block_lifetime_seconds": "histogram", "kv_block_idle_before_evict_seconds": "histogram",
    "kv_block_reuse_gap_seconds": "histogram", "admission_rejections": "counter",
    "spec_decode_num_drafts": "counter", "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "spec_decode_num_accepted_tokens_per_pos": "counter",
}  # fmt: skip
RESIDENCY = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60,
             120, 300, 600, 1200, 1800]  # fmt: skip
# Exported only with --speculative-config, as in vLLM (tests/spec/test_spec_engine.py).
SPEC_FAMILIES = {f for f in VLLM_TYPES if f.startswith("spec_decode_")}
# vLLM's bucket upper bounds (buckets.py), by family.
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
BUCKETS = {
    "e2e_request_latency_seconds": LATENCY,
    "request_queue_time_seconds": LATENCY,
    "request_decode_time_seconds": LATENCY,
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                                    160.0, 640.0, 2560.0],
    "inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200],  # 1-2-5 up to max_model_len
    "kv_block_lifetime_seconds": RESIDENCY,
    "kv_block_idle_before_evict_seconds": RESIDENCY,
    "kv_block_reuse_gap_seconds": RESIDENCY,
}  # fmt: skip


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cfg = tiny_llama_config()
    d = write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))
    engine = EngineConfig.from_options(
        model=str(d), dtype="float32", num_blocks=64, max_model_len=MAX_LEN, block_size=16,
        kv_cache_metrics=True, kv_cache_metrics_sample=1.0,
    )  # fmt: skip
    llm, _, app, _ = build_server(engine, ServerOptions(served_model_name="tiny"))
    prompt = list(range(3, 40))
    with TestClient(app) as c:
        for _ in range(2):  # the second one hits the prefix cache
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        text = c.get("/metrics").text
    llm.engine.check_integrity()
    yield {f.name: f for f in text_string_to_metric_families(text)}


def test_every_vllm_family_is_exported_with_vllms_type_and_labels(scraped: dict[str, Any]) -> None:
    assert set(VLLM_TYPES) == VLLM_FAMILIES
    for family, kind in VLLM_TYPES.items():
        name = metric_name(family)
        assert name == "vllm:" + family
        if family in SPEC_FAMILIES:
            assert name not in scraped and name.removesuffix("_total") not in scraped
            continue
        # The parser names a counter family without its _total suffix.
        fam = scraped.get(name) or scraped.get(name.removesuffix("_total"))
        assert fam is not None, f"{name} missing"
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        extra = {
            "num_requests_waiting_by_reason": {"reason"},
            "prompt_tokens_by_source": {"source"},
            "prompt_tokens_cached_by_source": {"source"},
            "request_success": {"finished_reason"},
        }.get(family, set())
        for s in fam.samples:  # vLLM's cache_config_info has the config's labels + engine
            if family == "admission_rejections":  # vLLM's has no engine label
                assert set(s.labels) == {"model_name", "reason"}, s
                continue
            assert s.labels.get("model_name", "tiny") == "tiny" and s.labels["engine"] == "0"
            assert "model_name" in s.labels or family == "cache_config_info", s
            if family != "cache_config_info":
                assert set(s.labels) - {"le"} == {"model_name", "engine", *extra}, s
    assert not any(n.startswith("kvstack:kv_cache_usage") for n in scraped)  # no aliases


def test_buckets_are_vllms(scraped: dict[str, Any]) -> None:
    assert request_tokens_buckets(MAX_LEN) == BUCKETS["request_prompt_tokens"]
    for family, want in BUCKETS.items():
        les = [
            float(s.labels["le"])
            for s in scraped["vllm:" + family].samples
            if s.name.endswith("_bucket")
        ]
        assert les == [*map(float, want), math.inf], family


def value(scraped: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    fam = scraped[name]
    total = 0.0
    for s in fam.samples:
        if s.name == fam.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def test_values_follow_vllms_definitions(scraped: dict[str, Any]) -> None:
    """Two requests of 37 prompt tokens and 4 output tokens; the second reuses two blocks."""
    assert value(scraped, "vllm:prompt_tokens", "_total") == 74
    assert value(scraped, "vllm:generation_tokens", "_total") == 8
    assert value(scraped, "vllm:prompt_tokens_cached", "_total") == 32
    assert value(scraped, "vllm:prefix_cache_hits", "_total") == 32
    assert value(scraped, "vllm:request_success", "_total", finished_reason="length") == 2
    assert value(scraped, "vllm:request_prompt_tokens", "_sum") == 74
    assert value(scraped, "vllm:request_prefill_kv_computed_tokens", "_sum") == 74 - 32
    assert value(scraped, "vllm:request_params_max_tokens", "_sum") == 8
    for family in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_prefill_time_seconds", "request_decode_time_seconds",
                   "request_inference_time_seconds", "time_to_first_token_seconds",
                   "request_time_per_output_token_seconds"):  # fmt: skip
        assert value(scraped, "vllm:" + family, "_count") == 2, family
    assert value(scraped, "vllm:inter_token_latency_seconds", "_count") == 6  # 3 gaps each
    # Every token the engine ran is in exactly one step's observation.
    assert (
        value(scraped, "vllm:iteration_tokens_total", "_sum")
        == value(scraped, "kvstack:prefill_tokens_computed", "_total") + 2 * 3
    )  # decode steps: tokens 2..4 of each request
    info = scraped["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16" and info["enable_prefix_caching"] == "True"
    assert info["num_gpu_blocks"] == "64"
    # vLLM 0.32's breakdowns: the three sources sum to prompt_tokens.
    by_source = {k: value(scraped, "vllm:prompt_tokens_by_source", "_total", source=k)
                 for k in ("local_compute", "local_cache_hit", "external_kv_transfer")}  # fmt: skip
    assert by_source == {"local_compute": 74 - 32, "local_cache_hit": 32, "external_kv_transfer": 0}
    cached = {s.labels["source"]: s.value
              for s in scraped["vllm:prompt_tokens_cached_by_source"].samples
              if s.name.endswith("_total")}  # fmt: skip
    assert cached == {"device": 32, "host": 0, "p2p": 0, "disk": 0, "external_unspecified": 0}
    waiting = {s.labels["reason"]: s.value
               for s in scraped["vllm:num_requests_waiting_by_reason"].samples}  # fmt: skip
    assert waiting == {"capacity": 0, "deferred": 0}


def test_waiting_by_reason_counts_tier_lookups_as_deferred() -> None:
    """vLLM's ``deferred`` reason is a transient wait (KV transfer): here a request whose
    offload-tier lookup is in flight; the rest wait for capacity."""
    from kvstack.config.engine import SchedulerConfig
    from kvstack.core.request import Request, SamplingParams
    from kvstack.kv.manager import KVCacheManager
    from kvstack.sched.scheduler import Scheduler
    from kvstack.serve.metrics.server import ServerMetrics

    class Loading:  # the one method of TierConnector the count reads
        def is_loading(self, req: Request) -> bool:
            return req.request_id in ("r1", "r3")

    sched = Scheduler(SchedulerConfig(), KVCacheManager(8, 16), 64)
    for i in range(4):
        sched.waiting.append(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1)))
    assert sched.num_waiting_deferred == 0  # no tiers: nothing is deferred
    sched.connector = Loading()  # type: ignore[assignment]
    assert (sched.num_waiting, sched.num_waiting_deferred) == (4, 2)
    m = ServerMetrics("tiny")
    stats = _stats(num_waiting=4, num_waiting_deferred=2)
    m.update_engine(stats, _kv())
    fams = {f.name: f for f in text_string_to_metric_families(_render(m))}
    got = {s.labels["reason"]: s.value for s in fams["vllm:num_requests_waiting_by_reason"].samples}
    assert got == {"capacity": 2, "deferred": 2}
    assert value(fams, "vllm:num_requests_waiting") == 4  # the sum, as vLLM's


def test_block_residency_is_vllms_kv_cache_metrics() -> None:
    """Block 0 allocated at t=0, hit at 1 s and 1.5 s, handed out again at 4 s: lifetime 4,
    idle 2.5, one reuse gap of 0.5; block 1 never hit: lifetime 4, idle 4, no gap."""
    from kvstack.kv.block_pool import BlockPool
    from kvstack.kv.residency import BlockResidency
    from kvstack.serve.metrics.server import ServerMetrics

    now = [0]
    residency = BlockResidency(1.0, clock_ns=lambda: now[0])
    pool = BlockPool(4, residency=residency)
    b0, b1 = pool.allocate(2)
    for t in (1_000_000_000, 1_500_000_000):
        now[0] = t
        pool.touch([b0])
    pool.free([b0] * 3)  # allocated + two hits: three references
    pool.free([b1])
    now[0] = 4_000_000_000
    pool.allocate(4)  # blocks 2, 3 first (never used: no sample), then 0 and 1
    samples = residency.drain()
    assert [(s.lifetime_s, s.idle_s, s.reuse_gaps_s) for s in samples] == [
        (4.0, 2.5, (0.5,)),
        (4.0, 4.0, ()),
    ]
    assert residency.drain() == [] and residency.num_tracked == 4
    m = ServerMetrics("tiny", kv_cache_metrics=True)
    m.on_residency(samples)
    fams = {f.name: f for f in text_string_to_metric_families(_render(m))}
    assert value(fams, "vllm:kv_block_lifetime_seconds", "_count") == 2
    assert value(fams, "vllm:kv_block_lifetime_seconds", "_sum") == 8.0
    assert value(fams, "vllm:kv_block_idle_before_evict_seconds", "_sum") == 6.5
    assert value(fams, "vllm:kv_block_idle_before_evict_seconds", "_bucket", le="2.0") == 0
    assert value(fams, "vllm:kv_block_idle_before_evict_seconds", "_bucket", le="5.0") == 2
    assert value(fams, "vllm:kv_block_reuse_gap_seconds", "_count") == 1
    assert value(fams, "vllm:kv_block_reuse_gap_seconds", "_bucket", le="0.2") == 0
    assert value(fams, "vllm:kv_block_reuse_gap_seconds", "_bucket", le="0.5") == 1
    # Sampling: only allocations the draw admits are followed (vLLM's random.random()).
    draws = iter([0.9, 0.1])
    sampled = BlockResidency(0.5, clock_ns=lambda: 0, rng=lambda: next(draws))
    sampled.on_allocated(0)
    sampled.on_allocated(1)
    assert sampled.num_tracked == 1
    assert "vllm:kv_block_lifetime_seconds" not in _render(ServerMetrics("tiny"))  # off by default


def _render(m: Any) -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.registry).decode()


def _kv() -> Any:
    from kvstack.kv.base import KVCacheStats

    return KVCacheStats(8, 8, 0, 0, 0.0, 0, 0, 0, 0)


def _stats(**kw: Any) -> Any:
    import dataclasses

    from kvstack.engine.stats import EngineStats

    required = [
        f for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]  # fmt: skip
    base: dict[str, Any] = {f.name: 0 for f in required}
    base.update(prefix_hit_rate=0.0, kv_usage=0.0, kv_usage_avg=0.0, kv_waste_avg=0.0,
                kv_waste_peak=0.0)  # fmt: skip
    return EngineStats(**{**base, **kw})


def test_admission_rejections_count_the_max_waiting_429s(tmp_path: Any) -> None:
    """vLLM's ``max_num_queued_reqs`` reason is kvstack's ``--max-waiting`` (the 429)."""
    import asyncio
    import dataclasses

    from kvstack import LLM
    from kvstack.core.request import SamplingParams
    from kvstack.serve.async_engine import AsyncEngine, QueueFullError
    from kvstack.serve.metrics.server import ServerMetrics
    from kvstack.serve.output_stream import RequestInfo

    cfg = tiny_llama_config()
    llm = LLM(str(write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg))),
              dtype="float32", num_blocks=16)  # fmt: skip
    m = ServerMetrics("tiny")
    engine = AsyncEngine(llm.engine, max_waiting=2, metrics=m)  # its loop is not started
    engine.stats = dataclasses.replace(engine.stats, num_waiting=2)  # two already wait
    sp, info = SamplingParams(max_tokens=1), RequestInfo("completions")
    for _ in range(3):
        with pytest.raises(QueueFullError):
            asyncio.run(engine.add("r", [1, 2], sp, info))
    fams = {f.name: f for f in text_string_to_metric_families(_render(m))}
    got = {s.labels["reason"]: s.value for s in fams["vllm:admission_rejections"].samples
           if s.name.endswith("_total")}  # fmt: skip
    assert got == {"max_num_queued_reqs": 3, "max_num_queued_tokens": 0}
