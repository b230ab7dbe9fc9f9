"""The API-keyed ``kvstack serve`` process of ``tests/serve/test_server*.py`` (a free
loopback port, small limits, a request log) and its checks: a ``/metrics`` value, and
waiting until no request runs or waits and no KV block is used."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from server_util import ServerProcess

KEY = "test-key"


@contextmanager
def keyed_server(d: Path) -> Iterator[ServerProcess]:
    """The server with ``--api-key KEY``, its log and request log under ``d``."""
    args = [
        "--api-key",
        KEY,
        "--max-model-len",
        "512",
        "--max-body-bytes",
        "65536",
        "--request-log",
        str(d / "requests.jsonl"),
        "--max-num-seqs",
        "32",
    ]
    with ServerProcess(args, d / "server.log") as s:
        yield s


def metric(srv: ServerProcess, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_idle(srv: ServerProcess, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            metric(srv, "vllm:num_requests_running") == 0
            and metric(srv, "vllm:num_requests_waiting") == 0
            and metric(srv, "vllm:kv_cache_usage_perc") == 0
        ):
            return
        time.sleep(0.1)
    raise AssertionError("server did not go idle (leaked KV blocks or a hung request?)")
