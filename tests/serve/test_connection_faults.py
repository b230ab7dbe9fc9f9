"""Slowloris clients against ``kvstack serve``'s uvicorn config (``server.uvicorn_config``):
partial headers and a partial body were held open > 20 s, and connections had no cap."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.server import ServerOptions, uvicorn_config
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from server_util import free_port

WAIT_S = 30.0  # far past every deadline below: a hang fails the test, it never passes


@dataclass
class Live:
    port: int
    engine: AsyncEngine
    server: uvicorn.Server

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S)
        return s


def recv_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection (socket.timeout if it never does)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


@contextmanager
def serving(
    path: Path, header_timeout: float, body_timeout: float, max_connections: int
) -> Iterator[Live]:
    llm = LLM(str(path), dtype="float32", num_blocks=64, max_model_len=128)
    engine = AsyncEngine(llm.engine)
    app = create_app(engine, ServerConfig(model_name="tiny", body_timeout_s=body_timeout))
    opts = ServerOptions(
        port=free_port(), header_timeout=header_timeout, max_connections=max_connections
    )
    server = uvicorn.Server(uvicorn_config(app, opts))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
        assert thread.is_alive(), "server failed to start"
    yield Live(opts.port, engine, server)
    server.should_exit = True
    thread.join(30)
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return path


@pytest.fixture(scope="module")
def live(tiny_gguf: Path) -> Iterator[Live]:
    """Short deadlines (0.5 s) so the deadline tests are quick."""
    with serving(tiny_gguf, header_timeout=0.5, body_timeout=0.5, max_connections=4) as srv:
        yield srv


def test_partial_headers_are_closed_at_the_deadline(live: Live) -> None:
    with live.connect() as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        assert recv_all(s) == b""  # closed without an answer


def test_a_slowloris_on_a_kept_alive_connection_is_closed_too(live: Live) -> None:
    with live.connect() as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # keeps trickling: no keep-alive expiry
        assert recv_all(s) == b""


def test_an_idle_kept_alive_connection_is_left_to_keep_alive(live: Live) -> None:
    """The header deadline starts with the next request's first byte, not when the last
    response ended: closing an idle pooled connection races a client reusing it."""
    with live.connect() as s:
        for _ in range(2):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(1.5)  # past the 0.5 s header deadline, inside uvicorn's 5 s keep-alive


def test_partial_body_is_408(live: Live) -> None:
    with live.connect() as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\nConnection: close\r\n\r\n{"prompt":'
        )
        answer = recv_all(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"type":"timeout"' in answer


def test_connections_past_the_cap_get_503(tiny_gguf: Path) -> None:
    """Deadlines far past the test's length: with 0.5 s ones a loaded machine let the held
    connections expire before the extra one was counted (CI saw a 200)."""
    with serving(tiny_gguf, WAIT_S, WAIT_S, max_connections=4) as live:
        _check_the_cap(live)


def _check_the_cap(live: Live) -> None:
    held = [live.connect() for _ in range(4)]
    try:
        for s in held:  # headers sent, body pending: each holds a connection and a task
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        # uvicorn counts open connections when a request's headers are parsed: the extra
        # one must connect only after the held ones' headers were (a loaded machine parsed
        # them after the extra connected, and all five got 503).
        deadline = time.monotonic() + WAIT_S
        while len(live.server.server_state.tasks) < len(held):
            assert time.monotonic() < deadline, "the held requests never started"
            time.sleep(0.01)
        with live.connect() as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert recv_all(extra).startswith(b"HTTP/1.1 503")
        readable, _, _ = select.select(held, [], [], 0.2)
        assert readable == [], "the 4 allowed connections were answered (refused) too"
    finally:
        for s in held:
            s.close()
    with live.connect() as s:  # the held ones are gone: served again
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert recv_all(s).startswith(b"HTTP/1.1 200")
