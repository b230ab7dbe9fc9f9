"""The Grafana dashboard and the KEDA ScaledObject against a real Prometheus.

Debian's ``prometheus`` (installed by ``scripts/prometheus.sh ensure``, like Redis)
listens on a free loopback port and scrapes a real ``kvstack serve`` every second; after
traffic that exercises every panel (repeated prompts for prefix hits, a cache reset for
host-tier hits, a press, a reused segment), every PromQL expression of
``deploy/grafana/kvstack.json`` and of ``deploy/k8s/scaledobject.yaml`` is evaluated
through Prometheus's HTTP API and must return a non-empty series of finite values. Both
processes are stopped at the end.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder
from server_util import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvstack.json"
SCALEDOBJECT = ROOT / "deploy" / "k8s" / "scaledobject.yaml"
RATE_WINDOW = "30s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    return [e.replace("$__rate_interval", RATE_WINDOW) for e in exprs]


def keda_exprs() -> list[str]:
    out = []
    for doc in yaml.safe_load_all(SCALEDOBJECT.read_text()):
        if doc and doc.get("kind") == "ScaledObject":
            out += [t["metadata"]["query"] for t in doc["spec"]["triggers"]]
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("dash")
    cfg = tiny_llama_config()
    model = write_hf_folder(d / "hf", cfg, random_llama_weights(cfg))
    args = ["--model", str(model), "--dtype", "float32", "--num-blocks", "64",
            "--max-model-len", "256", "--kv-offload", "host:16MiB"]  # fmt: skip
    with ServerProcess(args, d / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def prometheus(engine: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    subprocess.run(["bash", str(ROOT / "scripts" / "prometheus.sh"), "ensure"], check=True)
    d = tmp_path_factory.mktemp("prom")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "kvstack-engine",
            "static_configs": [{
                "targets": [f"127.0.0.1:{engine.port}"],
                # what the Kubernetes pod discovery adds, so KEDA's queries match verbatim
                "labels": {"namespace": "default", "pod": "kvstack-engine-0"},
            }],
        }],
    }  # fmt: skip
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(d / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={d / 'prometheus.yml'}",
             f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_for(lambda: httpx.get(url + "/-/ready").status_code == 200, proc)
            wait_for(lambda: bool(query(url, 'up{job="kvstack-engine"} == 1')), proc)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


def wait_for(ok: Any, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prometheus exited"
        try:
            if ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("prometheus did not get there in time")


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def finite(result: list[dict[str, Any]]) -> bool:
    return bool(result) and all(math.isfinite(float(s["value"][1])) for s in result)


def traffic(base: str) -> None:
    prompt = list(range(3, 3 + 70))
    with httpx.Client(base_url=base, timeout=120) as c:
        for body in (
            {"prompt": prompt, "max_tokens": 6, "ignore_eos": True},
            {"prompt": prompt, "max_tokens": 6, "ignore_eos": True},  # device prefix hit
            {"prompt": prompt[:40] + [9] * 40, "max_tokens": 4, "ignore_eos": True,
             "kv_press": "streaming_llm", "kv_press_ratio": 0.5},  # a press
        ):  # fmt: skip
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        part = {"type": "text", "text": "shared passage " * 3, "kvstack_segment": True}
        for lead in ("one", "two"):  # a segment computed standalone, then reused
            msgs = [{"role": "user", "content": [{"type": "text", "text": lead}, part]}]
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert c.post("/reset_prefix_cache").status_code == 200
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200  # served from the host tier


@pytest.mark.slow  # starts a server and Prometheus
def test_every_dashboard_and_keda_expression_returns_finite_series(
    engine: ServerProcess, prometheus: str
) -> None:
    exprs = dashboard_exprs() + keda_exprs()
    assert len(keda_exprs()) == 2 and len(exprs) > 20
    traffic(engine.url)
    deadline = time.monotonic() + 60
    bad: list[str] = exprs
    while bad and time.monotonic() < deadline:
        time.sleep(1.0)  # a scrape a second; rates need two samples after the traffic
        bad = [e for e in exprs if not finite(query(prometheus, e))]
    assert not bad, "\n".join(f"{e}: {query(prometheus, e)}" for e in bad)
    # The tier really served the last request, and the press really removed KV.
    assert float(query(prometheus, "sum(kvstack:offload_hits_total)")[0]["value"][1]) > 0
    assert float(query(prometheus, "sum(kvstack:press_dropped_tokens_total)")[0]["value"][1]) > 0
