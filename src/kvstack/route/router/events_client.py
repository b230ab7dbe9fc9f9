"""Follow one replica's KV event stream (``GET /v1/kv_events``) into the router's index.

One :class:`EventFollower` per backend: an asyncio task that reads the server-sent events
(``data: <json batch>`` messages; the batch format is ``kv_index.EventIndex``'s), hands each
batch to ``index.apply(replica_id, batch)`` and, whenever the stream ends or fails, or a
batch leaves the index stale (a sequence gap, a malformed batch), marks the replica *stale*
(``index.mark_stale``) so the policy falls back to its approximate index for it, then
reconnects with exponential backoff (0.5 s doubling to 5 s; back to 0.5 s after a
connection that delivered batches). Every connection starts with a snapshot batch, which
makes the replica fresh again. This is llm-d's KV-event
subscriber / NVIDIA Dynamo's KV router listener, over SSE instead of ZMQ.

Invariants: the loop never raises (every error is logged and turns into stale + backoff);
:meth:`stop` cancels it; between a disconnect and the next snapshot the replica is stale.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp

from kvstack.route.router.follower_task import FollowerTask

logger = logging.getLogger("kvstack.route.events")

MAX_LINE_BYTES = 256 * 1024 * 1024  # a snapshot of a big multi-tier cache is one long line


class EventSink(Protocol):
    """What a follower feeds: ``kv_index.EventIndex`` satisfies it."""

    def apply(self, replica_id: str, batch: Mapping[str, Any]) -> None: ...

    def mark_stale(self, replica_id: str) -> None: ...

    def is_fresh(self, replica_id: str) -> bool: ...


class SSEParser:
    """Incremental ``text/event-stream`` parser: bytes in, complete ``data`` payloads out.

    Per the SSE spec an event is the ``data:`` lines up to a blank line, joined by ``\\n``;
    comment lines (``:``) and other fields (``event:``, ``id:``, ``retry:``) are ignored.
    """

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._data: list[str] = []
        self._max = max_line_bytes

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        out: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self._max:
                    raise ValueError(f"SSE line over {self._max} bytes")
                return out
            line = bytes(self._buf[:nl]).rstrip(b"\r").decode("utf-8")
            del self._buf[: nl + 1]
            if not line:
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)


class EventFollower(FollowerTask):
    """Keeps ``index`` in step with the KV events of the replica at ``url``.

    ``headers`` go with every request (``Authorization`` when the servers need an API key).
    ``idle_timeout`` (seconds without any byte) treats a silent stream as lost; ``None``
    waits forever, which is right when the server sends no heartbeats: a hung replica is
    then caught by the health loop instead (``BackendPool`` restarts the follower).
    """

    index: EventSink

    def __init__(
        self,
        replica_id: str,
        url: str,
        index: EventSink,
        *,
        session: aiohttp.ClientSession | None = None,
        headers: Mapping[str, str] | None = None,
        connect_timeout: float = 5.0,
        idle_timeout: float | None = None,
        min_backoff: float = 0.5,
        max_backoff: float = 5.0,
    ) -> None:
        self.replica_id = replica_id
        self.url = url.rstrip("/") + "/v1/kv_events"
        self.index = index
        self.headers = dict(headers or {})
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self._session = session
        self.connected = False
        self.connects = 0  # successful connections (the first one included)
        self.disconnects = 0
        self.batches = 0
        self.last_batch_ts: float | None = None  # time.time() of the last applied batch
        self.last_error: str | None = None

    async def restart(self) -> None:
        """Drop the current connection and reconnect now (a fresh snapshot follows)."""
        await self.stop()
        self.index.mark_stale(self.replica_id)
        self.start()

    def state(self) -> dict[str, Any]:
        return {
            "source": "sse",
            "fresh": self.fresh,
            "connected": self.connected,
            "connects": self.connects,
            "disconnects": self.disconnects,
            "batches": self.batches,
            "last_batch_ts": self.last_batch_ts,
            "last_error": self.last_error,
        }

    async def _run(self) -> None:
        own = self._session is None
        session = self._session or aiohttp.ClientSession(auto_decompress=False)
        backoff = self.min_backoff
        try:
            while True:
                before = self.batches
                try:
                    await self._follow_once(session)
                    self.last_error = "stream ended"
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # network, HTTP, JSON or index error: resync
                    self.last_error = f"{type(e).__name__}: {e}"
                if self.connected:
                    self.disconnects += 1
                    logger.warning(
                        "kv events of %s lost (%s); routing to it is approximate until "
                        "the next snapshot",
                        self.replica_id,
                        self.last_error,
                    )
                self.connected = False
                self._mark_stale()
                if self.batches > before:  # that connection worked: reconnect quickly
                    backoff = self.min_backoff
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
        finally:
            self.connected = False
            if own:
                await session.close()

    def _mark_stale(self) -> None:
        try:
            self.index.mark_stale(self.replica_id)
        except Exception:
            logger.exception("mark_stale(%s) failed", self.replica_id)

    async def _follow_once(self, session: aiohttp.ClientSession) -> None:
        """One connection: apply batches until the stream ends."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout, sock_read=self.idle_timeout
        )
        headers = {**self.headers, "Accept": "text/event-stream"}
        async with session.get(self.url, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise ConnectionError(f"GET {self.url} answered {resp.status}")
            self.connected = True
            self.connects += 1
            logger.info("following kv events of %s", self.replica_id)
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                for data in parser.feed(chunk):
                    if data.strip() == "[DONE]":
                        return
                    batch = json.loads(data)
                    if not isinstance(batch, dict):
                        raise ValueError(f"event batch is not an object: {data[:80]!r}")
                    self.index.apply(self.replica_id, batch)
                    self.batches += 1
                    self.last_batch_ts = time.time()
                    if not self.index.is_fresh(self.replica_id):
                        # A sequence gap or a malformed batch: deltas no longer apply, and
                        # only a new connection brings the snapshot that resyncs.
                        raise ConnectionError("index went stale (gap or malformed batch)")
