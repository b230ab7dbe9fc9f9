"""``/metrics`` under vLLM v1's names, types, labels and buckets (``serve/metric_names.py``).

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

from kvstack.config import EngineConfig
from kvstack.serve.metric_names import VLLM_FAMILIES, metric_name, request_tokens_buckets
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
    "spec_decode_num_drafts": "counter", "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "spec_decode_num_accepted_tokens_per_pos": "counter",
}  # fmt: skip
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
}  # fmt: skip


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cfg = tiny_llama_config()
    d = write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))
    engine = EngineConfig.from_options(
        model=str(d), dtype="float32", num_blocks=64, max_model_len=MAX_LEN, block_size=16
    )
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
        for s in fam.samples:  # vLLM's cache_config_info has the config's labels + engine
            assert s.labels.get("model_name", "tiny") == "tiny" and s.labels["engine"] == "0"
            assert "model_name" in s.labels or family == "cache_config_info", s
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
