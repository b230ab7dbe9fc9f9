"""Child ``kvstack`` processes for the serving benchmarks (routing, prefill/decode).

Standard library only, like ``bench_common``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

KVSTACK = [sys.executable, "-m", "kvstack.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChildServer:
    """``kvstack ARGS --port P`` on a free loopback port, entered once ``/health`` answers
    200 and ``ready()`` holds; SIGTERM (then SIGKILL after 60 s) on exit."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        timeout_s: float = 180.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.log_path, self.env, self.timeout_s = args, log_path, env, timeout_s

    def ready(self) -> bool:
        """Extra readiness beyond ``/health`` (subclasses)."""
        return True

    def __enter__(self) -> ChildServer:
        self._log = open(self.log_path, "wb")
        cmd = [*KVSTACK, *self.args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`kvstack {self.args[0]}` exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200 and self.ready():
                        return self
            except (OSError, KeyError, IndexError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready in {self.timeout_s:.0f} s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def bench_serve(url: str, args: list[str]) -> dict[str, Any]:
    """One ``kvstack bench serve --base-url URL ARGS`` run; its saved JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*KVSTACK, "bench", "serve", "--base-url", url, *args, "--disable-tqdm"]
        cmd += ["--save-result", "--result-dir", tmp, "--result-filename", "r.json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return dict(json.loads((Path(tmp) / "r.json").read_text()))
