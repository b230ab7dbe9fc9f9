"""``kvstack router`` in front of vLLM: health on ``/health``, load from vLLM's metrics.

The backend here answers as a vLLM server does: ``/health`` 200, ``/load`` 404, and a
``/metrics`` page with vLLM's families (two engines, the labels vLLM puts on them).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvstack.route.router.backends import BackendPool
from kvstack.route.router.vllm_load import load_from_metrics
from server_util import serve_aiohttp

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
"""


def test_load_from_vllm_metrics() -> None:
    assert load_from_metrics(VLLM_METRICS) == (4, 7, 0.75)
    assert load_from_metrics("# TYPE x gauge\nx 1\n") is None  # not vLLM: no load
    assert load_from_metrics("garbage{") is None


def test_the_pool_reads_a_vllm_backends_load_from_its_metrics() -> None:
    app = web.Application()
    app.router.add_get("/health", lambda _: web.Response(status=200))
    app.router.add_get("/metrics", lambda _: web.Response(text=VLLM_METRICS))
    with serve_aiohttp(app) as url:

        async def go() -> tuple[bool, int, int, float]:
            pool = BackendPool([url], health_interval=30.0)
            await pool.start()
            try:
                b = pool.backends[url]
                ok = await pool.check(b)
                return ok, b.replica.running, b.replica.waiting, b.replica.kv_usage
            finally:
                await pool.stop()

        assert asyncio.run(go()) == (True, 4, 7, 0.75)
