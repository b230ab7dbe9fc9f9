"""Limits of servers started here, each with its own options: the waiting-queue limit
(429, ``vllm:admission_rejections``), the request timeout (408) and a graceful SIGTERM of a
`kvstack serve` process; the pin endpoint's checks (shorter than a block, over the pin
budget, no prefix cache) decided on the engine thread of an in-process app."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from server_util import ServerProcess


@pytest.mark.slow
def test_queue_limit_timeout_and_graceful_shutdown(tmp_path: Path) -> None:
    args = [
        "--max-waiting",
        "1",
        "--max-num-seqs",
        "1",
        "--request-timeout",
        "4",
        "--max-model-len",
        "1024",
    ]
    with ServerProcess(args, tmp_path / "server.log") as s:
        body = {"prompt": "Tell me a story.", "max_tokens": 16, "ignore_eos": True}

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as ac:
                return await asyncio.gather(
                    *(ac.post(s.url + "/v1/completions", json=body) for _ in range(6))
                )

        codes = [r.status_code for r in asyncio.run(burst())]
        assert 429 in codes and 200 in codes, codes
        second = asyncio.run(burst())
        limited = next(r for r in second if r.status_code == 429)
        assert limited.headers.get("retry-after") and limited.json()["error"]["type"]
        # vLLM's vllm:admission_rejections: --max-waiting is its max_num_queued_reqs.
        rejected = codes.count(429) + sum(r.status_code == 429 for r in second)
        metrics = httpx.get(s.url + "/metrics").text
        counted = {
            smp.labels["reason"]: smp.value
            for fam in text_string_to_metric_families(metrics)
            if fam.name == "vllm:admission_rejections"
            for smp in fam.samples
            if smp.name.endswith("_total")
        }
        assert counted == {"max_num_queued_reqs": rejected, "max_num_queued_tokens": 0}
        slow = httpx.post(s.url + "/v1/completions", timeout=60, json={**body, "max_tokens": 900})
        assert slow.status_code == 408 and "timed out" in slow.json()["error"]["message"]
        # SIGTERM while a request streams: it finishes, then the process exits 0.
        result: dict[str, Any] = {}

        def stream() -> None:
            with httpx.stream(
                "POST", s.url + "/v1/completions", timeout=60, json={**body, "stream": True}
            ) as r:
                result["lines"] = [ln for ln in r.iter_lines() if ln]

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        assert s.stop(signal.SIGTERM) == 0
        t.join(30)
        assert result["lines"][-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in result["lines"][-2]


@pytest.mark.slow
@pytest.mark.parametrize("prefix_cache", ["hash", "none"])
def test_pin_is_checked_on_the_engine_thread(
    prefix_cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pin endpoint's 400s (shorter than a block, over the pin budget, no prefix
    cache) are decided by the engine thread, never by the HTTP thread, and a pin that
    succeeds reports the blocks held from the engine thread too."""
    from fastapi.testclient import TestClient

    # 8 blocks of 16 tokens, max_pinned_fraction 0.5: pins may hold at most 4 blocks.
    llm = LLM("default", max_model_len=128, num_blocks=8, prefix_cache=prefix_cache)
    eng = llm.engine
    threads: list[str] = []

    def spy(real: Any) -> Any:
        def call(*args: Any) -> Any:
            threads.append(threading.current_thread().name)
            return real(*args)

        return call

    for name in ("check_pinnable", "pin_prefix", "num_pinned_blocks"):
        monkeypatch.setattr(eng, name, spy(getattr(eng, name)))
    app = create_app(AsyncEngine(eng), ServerConfig(model_name="m"))
    with TestClient(app) as c:

        def pin(n: int) -> httpx.Response:
            return c.post("/v1/cache/pin", json={"prompt": list(range(1000, 1000 + n))})

        if prefix_cache == "none":
            r = pin(32)
            assert r.status_code == 400 and "prefix cache" in r.json()["error"]["message"]
        else:
            short, long = pin(8), pin(5 * 16)
            assert short.status_code == 400 and "full block" in short.json()["error"]["message"]
            assert long.status_code == 400 and "at most 4" in long.json()["error"]["message"]
            assert {"type", "param", "code"} <= set(long.json()["error"])
            ok = pin(32)
            assert ok.status_code == 200, ok.text
            assert ok.json() == {"pinned_tokens": 32, "num_pinned_blocks": 2}
            unpin = c.post("/v1/cache/unpin", json={"prompt": list(range(1000, 1032))})
            assert unpin.json() == {"unpinned": True}
    assert threads and set(threads) == {"kvstack-engine"}, threads
