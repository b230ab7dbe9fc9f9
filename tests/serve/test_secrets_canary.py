"""No secret leaves the process: ``kvstack serve`` runs with a canary password in its
``--kv-offload`` Redis URL and a canary ``--api-key``, ``kvstack router`` in front of it
with the same key; every GET either answers without the key (and, for good measure, with
it), every line either logs and the server's request log are scanned for both canaries.

Nothing listens at the Redis URL: the tier fails to connect and backs off (its errors
are logged: the likeliest place for a URL to leak), the server serves regardless. The
password once showed in ``vllm:cache_config_info{kv_offload="redis://:PASSWORD@..."}``
on the unauthenticated ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvstack.testing.soak import Proc, free_port
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from server_util import ServerProcess

PASSWORD = "canary-pw-5d1f0c7a"
KEY = "canary-key-9b24e6f3"
CANARIES = (PASSWORD, KEY)
# Never in the OpenAPI schema, or only reached by a browser.
EXTRA_GETS = ("/", "/openapi.json", "/docs", "/redoc", "/metrics", "/health", "/ping",
              "/version", "/load", "/router/state", "/v1/models")  # fmt: skip

pytestmark = pytest.mark.slow  # two processes, about 30 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Path]]:
    d = tmp_path_factory.mktemp("canary")
    cfg = tiny_llama_config()
    write_gguf(d / "t.gguf", cfg, random_llama_weights(cfg))
    redis = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0?timeout=0.1&backoff=0.5"
    args = [str(d / "t.gguf"), "--dtype", "float32", "--max-model-len", "128",
            "--num-blocks", "64", "--api-key", KEY, "--kv-offload", f"host:64MiB,{redis}",
            "--request-log", str(d / "requests.jsonl"), "-v"]  # fmt: skip
    with ServerProcess(args, d / "server.log") as server:
        router = Proc("router", ["router", "--backend", server.url, "--api-key", KEY], d / "r.log")
        router.start(60)
        try:
            yield server, router, d
        finally:
            router.stop()


def get_paths(url: str) -> list[str]:
    """Every GET path of the app at ``url``: its OpenAPI schema's, then ``EXTRA_GETS``."""
    r = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    schema = r.json() if r.status_code == 200 else {"paths": {}}
    paths = [p for p, ops in schema["paths"].items() if "get" in ops and "{" not in p]
    return paths + [p for p in EXTRA_GETS if p not in paths]


def fetch(url: str, headers: dict[str, str]) -> bytes:
    """The status line's code, headers and up to 256 KiB of the body (event streams are
    cut after their first chunks)."""
    out = bytearray()
    with httpx.stream("GET", url, headers=headers, timeout=10) as r:
        out += f"{r.status_code} {dict(r.headers)}\n".encode()
        try:
            for chunk in r.iter_bytes():
                out += chunk
                if len(out) > 256 * 1024 or "event-stream" in r.headers.get("content-type", ""):
                    break
        except httpx.ReadTimeout:
            pass
    return bytes(out)


def leaks(text: bytes) -> list[str]:
    return [c for c in CANARIES if c.encode() in text]


def test_no_get_and_no_log_line_shows_a_secret(stack: tuple[Proc, Proc, Path]) -> None:
    server, router, d = stack
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "the canary sings " * 8, "max_tokens": 4}
    for url in (server.url, router.url):  # traffic, so the tiers store and log
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200, r.text
        assert not leaks(r.content)
    labels = httpx.get(server.url + "/metrics").text
    assert 'kv_offload="host:64MiB,redis://:***@127.0.0.1' in labels, labels[-3000:]
    checked = []
    for base in (server.url, router.url):
        paths = get_paths(base)
        assert "/metrics" in paths and "/health" in paths
        for path in paths:
            for headers in ({}, auth):
                got = fetch(base + path, headers)
                assert not leaks(got), (base, path, headers, got[:3000])
                checked.append(path)
    assert len(checked) >= 2 * 2 * len(EXTRA_GETS)
    server.stop()
    router.stop()
    for log in (d / "server.log", d / "r.log", d / "requests.jsonl"):
        text = log.read_bytes()
        assert text, f"{log.name} is empty"
        bad = [line for line in text.splitlines() if leaks(line)]
        assert not bad, (log.name, bad[:5])
