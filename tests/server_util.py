"""Start a real ``kvstack serve`` process on a free loopback port for tests (the soak's
``Proc`` child), and in-process aiohttp / uvicorn servers."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstack.testing.soak import Proc, free_port

__all__ = ["ServerProcess", "free_port", "serve_aiohttp", "serve_uvicorn"]


class ServerProcess(Proc):
    """``with ServerProcess(["--api-key", "k"]) as srv: srv.url`` (terminated on exit);
    ``srv.tail()`` is the end of its log, ``srv.log`` the log file."""

    def __init__(self, args: list[str], log: Path, timeout_s: float = 180.0) -> None:
        super().__init__("server", ["serve", *args], log)
        self.timeout_s = timeout_s

    def __enter__(self) -> ServerProcess:
        self.log.write_bytes(b"")
        self.start(self.timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def serve_aiohttp(app: Any) -> Iterator[str]:
    """An aiohttp ``app`` on a free 127.0.0.1 port, served by its own loop in a thread;
    yields its base URL."""
    import asyncio
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
