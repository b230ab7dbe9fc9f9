"""``EngineReplica``: one kvstack engine and its HTTP app inside a Ray Serve replica.

Each replica runs a complete ``kvstack serve`` app (same OpenAI handling, errors and
metrics), built by ``build_server`` from the ``EngineConfig`` and ``ServerOptions`` the
deployment was bound with, on a free port of ``--replica-host``. It relays a call's
response bytes back through Ray as a stream: first ``{"status", "content_type"}``, then
the body chunks. It publishes its URL, block size and hash model id once
(``record_replica_metadata``) and its load every second (``record_routing_stats``).
Ray is imported inside ``__init__`` only (this module is imported by the driver too).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvstack.config.engine import EngineConfig
from kvstack.serve.server import ServerOptions

logger = logging.getLogger("kvstack.route.ray")


@dataclass(frozen=True)
class EngineCall:
    """One HTTP request relayed to a replica (what the router sees in ``args[0]``)."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EngineReplica:
    """One kvstack engine and its HTTP app inside a Ray Serve replica."""

    def __init__(
        self, engine: EngineConfig, server: ServerOptions, threads: int = 1, host: str = ""
    ) -> None:
        import torch
        import uvicorn
        from ray.util import get_node_ip_address

        from kvstack.serve.server import build_server

        torch.set_num_threads(max(1, threads))
        logging.getLogger("kvstack").setLevel(logging.INFO)
        host = host or "127.0.0.1"
        own = dataclasses.replace(server, host=host, port=_free_port(host))
        self.llm, self.engine, app, _ = build_server(engine, own)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=own.host, port=own.port, log_level="warning")
        )
        self._http = threading.Thread(target=self.server.run, name="kvstack-http", daemon=True)
        self._http.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._http.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"replica HTTP server did not start on {own.host}:{own.port}")
            time.sleep(0.05)
        public = get_node_ip_address() if own.host == "0.0.0.0" else own.host
        self.url = f"http://{public}:{own.port}"
        info = self.engine.routing_info  # fixed for the engine's life
        self.meta = {
            "url": self.url, "block_size": info.block_size, "model_id": info.model_id,
            "pid": os.getpid(), "node": socket.gethostname(),
        }  # fmt: skip
        self._session: aiohttp.ClientSession | None = None
        logger.info("replica serving on %s", self.url)

    def record_replica_metadata(self) -> dict[str, Any]:
        return dict(self.meta)

    async def record_routing_stats(self) -> dict[str, Any]:
        s = self.engine.stats
        return {"running": s.num_running, "waiting": s.num_waiting, "kv_usage": s.kv_usage}

    async def check_health(self) -> None:
        if not self.engine.alive or not self._http.is_alive():
            raise RuntimeError("kvstack engine loop or HTTP server stopped")

    async def __call__(self, call: EngineCall) -> AsyncIterator[Any]:
        """Relay ``call`` to this replica's server: a header dict, then body chunks."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        async with self._session.request(
            call.method, self.url + call.path, data=call.body, headers=call.headers
        ) as resp:
            yield {"status": resp.status, "content_type": resp.headers.get("content-type", "")}
            async for chunk in resp.content.iter_any():
                yield chunk

    def __del__(self) -> None:  # Ray Serve calls it when it stops the replica
        server = getattr(self, "server", None)
        if server is not None:
            server.should_exit = True
            self._http.join(timeout=30)
            self.llm.shutdown()
