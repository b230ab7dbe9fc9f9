"""``GET /v1/kv_events``: the engine's KV events as a Server-Sent-Events stream.

A KV-aware router (``kvstack router --policy kv_events``, the Ray Serve router) keeps
an exact index of what each replica caches by following this stream, as llm-d's KV
indexer follows vLLM's ZMQ ``kv_events``. SSE over the server's own port needs no
second socket and passes any HTTP proxy.

Wire format (one ``data: <json>`` line and a blank line per batch)::

    {"seq": 0, "ts": ..., "snapshot": true,
     "events": [{"type": "BlockSnapshot", "block_hashes": [...], "medium": "device"},
                {"type": "SegmentSnapshot", "segment_keys": [...], "medium": "device"}]}
    {"seq": 1, "ts": ..., "snapshot": false, "events": [{"type": "BlockStored", ...}, ...]}
    {"seq": 2, ...}

Invariants:

* ``seq`` grows by exactly one per batch on a connection; the first batch is always a
  snapshot of every hash the device cache (and each host or disk tier) serves at that
  instant, and of the device's ready segment entries (segment reuse: ``SegmentStored`` /
  ``SegmentRemoved`` follow them), and the batches after it carry exactly the events
  published after that instant (no loss; a tier event racing the snapshot may repeat,
  harmlessly).
* Consistency comes from the engine thread: events are published there, and the
  snapshot is taken there (``AsyncEngine.run``), under the same lock that numbers
  events, so the snapshot and the event cursor describe the same moment.
* Events live in one ring shared by all connections, holding only what some connection
  has not sent yet and bounded by weight. A connection that falls so far behind that
  the ring dropped events it has not sent is closed; the client reconnects and gets a
  fresh snapshot (a gap is never papered over).
* Idle connections get a ``: keep-alive`` comment every ``keepalive_s`` so a client can
  tell a silent replica from a dead one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from kvstack.kv.events import KVEvent, event_weight
from kvstack.serve.async_engine import AsyncEngine


class KVEventBroadcaster:
    """Numbers the engine's KV events and serves them to any number of SSE clients.

    Events are kept only while a connection still needs them: the ring holds what the
    slowest connection has not sent yet (nothing at all without connections), bounded by
    ``max_weight`` (token ids + hashes; a 4,000-token prompt's event weighs ~4,000).
    At most ``max_connections`` stream at once (``try_open``; a router needs one per
    replica): each connect costs a snapshot of every tier's hashes on the engine thread,
    so unbounded connects would stall the engine.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_weight: int = 4_000_000,
        max_connections: int = 16,
        poll_s: float = 0.05,
        keepalive_s: float = 5.0,
    ) -> None:
        self.engine = engine
        self.max_weight = max_weight
        self.max_connections = max_connections
        self._open = 0  # streams started and not ended (event loop only)
        self.poll_s = poll_s
        self.keepalive_s = keepalive_s
        self._lock = threading.Lock()
        self._ring: deque[tuple[int, KVEvent]] = deque()
        self._weight = 0
        self._next = 0  # number the next published event gets
        self._cursors: dict[int, int] = {}  # connection -> next event number it needs
        self._conns = itertools.count()
        engine.subscribe_kv_events(self._publish)

    def _publish(self, event: KVEvent) -> None:  # engine thread (tiers: the I/O thread)
        with self._lock:
            if self._cursors:
                self._ring.append((self._next, event))
                self._weight += event_weight(event)
                while self._weight > self.max_weight:  # the slowest connection will close
                    self._weight -= event_weight(self._ring.popleft()[1])
            self._next += 1

    def _snapshot(self, conn: int) -> tuple[int, list[dict[str, Any]]]:  # engine thread
        """Register ``conn`` and return its cursor and one ``BlockSnapshot`` per medium
        that can list its blocks: the device cache, and the host and disk tiers (Redis is
        shared and cannot), then the device's ``SegmentSnapshot``. Runs between engine
        steps, under the lock that numbers events.
        """
        with self._lock:
            # Tier events come from the I/O thread: one that lands between this read and
            # the cursor is sent after the snapshot too; set semantics absorb it.
            held = self.engine.held_block_hashes()
            self._cursors[conn] = self._next
            snaps = [
                {"type": "BlockSnapshot", "block_hashes": [h.hex() for h in hs], "medium": m}
                for m, hs in held.items()
            ]
            keys = [k.hex() for k in self.engine.held_segment_keys()]
            snaps.append({"type": "SegmentSnapshot", "segment_keys": keys, "medium": "device"})
            return self._next, snaps

    def _since(self, conn: int, cursor: int) -> tuple[list[KVEvent], int] | None:
        """Events numbered ``>= cursor`` and the new cursor; None if some were dropped.
        Forgets the events no connection needs any more."""
        with self._lock:
            if cursor >= self._next:
                return [], cursor
            if not self._ring or self._ring[0][0] > cursor:
                return None
            first = cursor - self._ring[0][0]
            events = [self._ring[i][1] for i in range(first, len(self._ring))]
            self._cursors[conn] = self._next
            self._trim()
            return events, self._next

    def _trim(self) -> None:
        oldest = min(self._cursors.values(), default=self._next)
        while self._ring and self._ring[0][0] < oldest:
            self._weight -= event_weight(self._ring.popleft()[1])

    def _close(self, conn: int) -> None:
        with self._lock:
            self._cursors.pop(conn, None)
            self._trim()

    def open_stream(self) -> AsyncIterator[bytes] | None:
        """One connection's stream, or None when ``max_connections`` are open. The slot is
        held until the stream object is gone (ended, or dropped unstarted by a client
        that left before the first byte)."""
        if self._open >= self.max_connections:
            return None
        self._open += 1
        gen = self._stream()
        weakref.finalize(gen, self._release)
        return gen

    def _release(self) -> None:
        self._open -= 1

    async def _stream(self) -> AsyncIterator[bytes]:
        """A snapshot batch, then every later event in batches."""
        conn = next(self._conns)
        try:
            cursor, snaps = await self.engine.run(lambda: self._snapshot(conn))
            seq = 0
            yield _frame({"seq": seq, "ts": time.time(), "snapshot": True, "events": snaps})
            idle = 0.0
            while self.engine.alive:
                got = self._since(conn, cursor)
                if got is None:  # too slow: close; the client reconnects for a snapshot
                    return
                events, cursor = got
                if events:
                    seq += 1
                    batch = {"seq": seq, "ts": time.time(), "snapshot": False}
                    yield _frame({**batch, "events": [e.to_dict() for e in events]})
                    idle = 0.0
                elif idle >= self.keepalive_s:
                    yield b": keep-alive\n\n"
                    idle = 0.0
                await asyncio.sleep(self.poll_s)
                idle += self.poll_s
        finally:
            self._close(conn)


def _frame(batch: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(batch, separators=(",", ":")).encode() + b"\n\n"
