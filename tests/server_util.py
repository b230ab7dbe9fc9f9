"""Start a real ``kvstack serve`` process on a free loopback port for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``with ServerProcess(["--api-key", "k"]) as srv: srv.url`` (terminated on exit)."""

    def __init__(self, args: list[str], log: Path, timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "kvstack.cli", "serve", "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def serve_aiohttp(app: Any) -> Iterator[str]:
    """An aiohttp ``app`` on a free 127.0.0.1 port, served by its own loop in a thread;
    yields its base URL."""
    import asyncio
    import socket
    import threading

    from aiohttp import web

    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextmanager
def serve_uvicorn(app: Any, **options: Any) -> Iterator[str]:
    """A kvstack ``app`` (``create_app``) under uvicorn on a free 127.0.0.1 port, in a
    thread of this process (``ServerOptions`` fields as ``options``); yields its URL."""
    import asyncio
    import threading

    import uvicorn

    from kvstack.serve.server import ServerOptions, uvicorn_config

    options.setdefault("port", free_port())
    opts = ServerOptions(**options)
    server = uvicorn.Server(uvicorn_config(app, opts))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
        if not thread.is_alive():
            raise RuntimeError("server failed to start")
    try:
        yield f"http://127.0.0.1:{opts.port}"
    finally:
        server.should_exit = True
        thread.join(30)
