"""Start a throwaway ``redis-server`` on a free loopback port (tests and benchmarks).

Runs ``scripts/redis.sh start PORT DIR`` from the source tree, which installs Redis from
Debian packages when it is missing and starts it as a pure cache (no snapshots, LRU
past ``maxmemory``). ``kill()`` and ``restart()`` let tests inject the faults of a real
deployment: the server dying mid-run and coming back empty on the same port.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "redis.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    def __init__(self, port: int | None = None, startup_timeout: float = 60.0) -> None:
        if not SCRIPT.is_file():
            raise FileNotFoundError(f"{SCRIPT} not found (run from a kvstack source tree)")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvstack-redis-")
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> LocalRedis:
        self.proc = subprocess.Popen(
            ["bash", str(SCRIPT), "start", str(self.port), self.dir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """Kill the server at once (SIGKILL): what a crash looks like to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> LocalRedis:
        """Kill and start again on the same port; the new server is empty."""
        self.kill()
        return self.start()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()
