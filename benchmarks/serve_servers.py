"""Servers for ``benchmarks/serve.py``: start kvstack's or vLLM's OpenAI server as a child
process on a free loopback port, wait for ``/health``, measure its CPU, stop it (SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench_common import (
    BENCH_VENVS,
    HF_MODEL_DIR,
    REPO_ROOT,
    log,
    venv_python,
)
from engine_procs import peer_command

MAX_NUM_SEQS, MAX_MODEL_LEN = 16, 2048
LOG_DIR = BENCH_VENVS / "logs"

# --------------------------------------------------------------------------- processes


def http(method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """``(status, parsed JSON or text)`` of one request; status 0 when it failed."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (OSError, ValueError):
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by process ``root`` and its live descendants."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(p for p, pp in parent.items() if pp == pid)
    return total


class Server:
    """A server child process in its own process group, with its log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = LOG_DIR / f"serve-{name}.log"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until ``GET /health`` answered 200; raises if the process died."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.tail()}")
            if http("GET", f"{self.base}/health", timeout=5)[0] == 200:
                return time.perf_counter() - t0
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s: {self.tail()}")

    def tail(self, n: int = 8) -> str:
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGTERM to the group, SIGKILL after ``grace_s``; the main process's exit code."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log(f"[{self.name}] still running {grace_s:.0f} s after SIGTERM: SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers of the group, if any
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


def kvstack_command(port: int) -> tuple[list[str], dict[str, str]]:
    exe = Path(sys.executable).with_name("kvstack")
    cmd = [str(exe), "serve", "--port", str(port)]
    cmd += ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN)]
    return cmd, dict(os.environ)


def vllm_command(port: int, dtype: str = "bfloat16") -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server with offline_throughput's vLLM environment (VLLM_ENV, libiomp5)."""
    _, env = peer_command("vllm", Path(os.devnull), Path(os.devnull))
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for POST /reset_prefix_cache
    model = str(HF_MODEL_DIR)
    cmd = [str(venv_python("vllm")), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", model, "--tokenizer", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += ["--max-num-batched-tokens", "2048", "--dtype", dtype]
    cmd += ["--served-model-name", "smollm2", "--enable-prefix-caching"]
    cmd += ["--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens
    return cmd, env


def vllm_fp32_command(port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's server in float32: its best setting on a CPU without AVX512-BF16 / AMX, where
    its bf16 has no native kernels (offline it runs even with kvstack's bf16 there)."""
    return vllm_command(port, "float32")


SERVERS: dict[str, tuple[Callable[[int], tuple[list[str], dict[str, str]]], float]] = {
    "kvstack": (kvstack_command, 300.0),
    "vllm": (vllm_command, 600.0),  # minutes to start on this machine
    "vllm-fp32": (vllm_fp32_command, 600.0),
}


@contextlib.contextmanager
def running(name: str) -> Iterator[tuple[Server, dict[str, Any]]]:
    """Start server ``name``, wait for /health, yield it and its info; always stop it."""
    make, health_timeout = SERVERS[name]
    port = free_port()
    cmd, env = make(port)
    log(f"[{name}] starting on port {port} (log {LOG_DIR / f'serve-{name}.log'})")
    server = Server(name, cmd, env, port)
    env_set = {k: v for k, v in env.items() if os.environ.get(k) != v}
    unset = sorted(k for k in os.environ if k not in env)
    info: dict[str, Any] = {"command": cmd, "env_set": env_set, "env_unset": unset}
    info["log"] = str(server.log_path)
    try:
        info["startup_s"] = round(server.wait_healthy(health_timeout), 1)
        info["version"] = (http("GET", f"{server.base}/version")[1] or {}).get("version")
        log(f"[{name}] {info['version']} healthy after {info['startup_s']} s")
        yield server, info
    finally:
        info["exit_code"] = server.stop()
        log(f"[{name}] stopped (exit code {info['exit_code']})")
