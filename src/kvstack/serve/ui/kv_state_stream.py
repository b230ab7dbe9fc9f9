"""``GET /v1/kv/state``: periodic snapshots of the KV cache as Server-Sent Events.

The web view (``serve/ui/static/``) reads this stream with ``fetch()`` (so the API key
travels in an ``Authorization`` header, never in a URL) and redraws its block map,
charts and request timeline from each frame. Wire format: one ``data: <json>`` line and
a blank line per snapshot, the JSON being ``serve/ui/kv_state.py``'s dict plus
``"snapshot": n`` (the server-wide number of the snapshot: a gap means frames a slow
reader never saw).

Invariants:

* No viewer, no work: snapshots are taken only for an open stream (``num_snapshots``
  counts them; it stays 0 on a server nobody watches).
* Throttled: at most one snapshot per ``min_interval_s`` for the whole server, shared by
  every viewer (two viewers cost what one does); a stream sends at most one frame per
  its ``interval_s`` (clamped to ``[min_interval_s, max_interval_s]``). A snapshot that
  took ``c`` seconds on the engine thread is reused for ``c / MAX_ENGINE_SHARE``: the
  view never takes more than that share of the engine thread (a 100k-block pool's
  ~0.1 s snapshot then comes every 2 s, not 4 times a second).
* Bounded per connection: a stream holds one frame, the newest. The next snapshot is
  taken only after the previous frame was handed to the transport, so a reader that
  stops reading stalls its own stream (it then skips to the newest snapshot) and never
  queues frames on the server.
* At most ``max_viewers`` streams at once; ``open_stream`` returns None past it (429).
* ``close`` (the server's first SIGTERM) ends every stream within one interval, so a
  graceful shutdown does not wait its whole grace period for an open page.
* Snapshots run on the engine thread (``AsyncEngine.kv_state``); the JSON encoding of a
  large one runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstack.serve.async_engine import AsyncEngine, EngineDeadError


class ViewerStream:
    """One viewer's frames; ``aclose`` (idempotent) ends them and frees the slot."""

    def __init__(self, gen: AsyncGenerator[bytes, None], release: Callable[[], None]) -> None:
        self._gen = gen
        self._release = weakref.finalize(self, release)  # runs once: closed, or collected

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._gen

    async def aclose(self) -> None:
        self._release()
        await self._gen.aclose()


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its ``ViewerStream`` when it ends, however it
    ends: Starlette cancels the sending task when the client disconnects and leaves the
    generator suspended, which would hold the viewer's slot until garbage collection."""

    def __init__(self, stream: ViewerStream, **kw: Any) -> None:
        super().__init__(stream, **kw)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()


MAX_ENGINE_SHARE = 0.05  # of the engine thread's time the snapshots may take


def _encode(state: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(state, separators=(",", ":")).encode() + b"\n\n"


class KVStateStream:
    """Serves ``/v1/kv/state`` to at most ``max_viewers`` streams (module docstring)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_viewers: int = 4,
        min_interval_s: float = 0.25,
        max_interval_s: float = 10.0,
        max_cells: int = 4096,
    ) -> None:
        self.engine = engine
        self.max_viewers = max_viewers
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.max_cells = max_cells
        self.num_snapshots = 0  # taken on the engine thread, ever
        self.num_viewers = 0  # streams started and not ended (event loop only)
        self.last_cost_s = 0.0  # engine-thread seconds the last snapshot took
        self.total_cost_s = 0.0  # ... and all of them
        self._latest: tuple[float, bytes] | None = None  # (monotonic time taken, frame)
        self._pending: asyncio.Future[bytes] | None = None  # the snapshot being taken
        self.closed = False  # set by ``close``: streams end within one interval

    def close(self) -> None:
        """End every stream within one interval and refuse new ones (server shutdown:
        a stream never ends by itself, and uvicorn waits for open responses)."""
        self.closed = True

    def clamp(self, interval_s: float) -> float:
        return min(self.max_interval_s, max(self.min_interval_s, interval_s))

    def open_stream(self, interval_s: float) -> ViewerStream | None:
        """One viewer's stream, or None when ``max_viewers`` are open. The slot is held
        until the stream is closed (``ViewerStream.aclose``: the response ends or the
        client left) or, for one never started, garbage collected."""
        if self.num_viewers >= self.max_viewers or self.closed:
            return None
        self.num_viewers += 1
        return ViewerStream(self._stream(self.clamp(interval_s)), self._release)

    def _release(self) -> None:
        self.num_viewers -= 1

    def _snapshot(self) -> dict[str, Any]:  # engine thread
        t0 = time.perf_counter()
        self.num_snapshots += 1
        state = self.engine.kv_state(self.max_cells)
        state["snapshot"] = self.num_snapshots
        self.last_cost_s = time.perf_counter() - t0
        self.total_cost_s += self.last_cost_s
        return state

    async def _take(self) -> bytes:
        state = await self.engine.run(self._snapshot)
        frame = await asyncio.get_running_loop().run_in_executor(None, _encode, state)
        self._latest = (time.monotonic(), frame)
        return frame

    async def frame(self) -> bytes:
        """The newest frame: the shared one if it is younger than ``min_interval_s`` (or
        its cost's share, see the module docstring), else a new snapshot (one at a time
        for all viewers)."""
        latest = self._latest
        fresh_s = max(self.min_interval_s, self.last_cost_s / MAX_ENGINE_SHARE)
        if latest is not None and time.monotonic() - latest[0] < fresh_s:
            return latest[1]
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._take())
        return await asyncio.shield(self._pending)

    async def _stream(self, interval_s: float) -> AsyncGenerator[bytes, None]:
        sent: bytes | None = None
        while self.engine.alive and not self.closed:
            started = time.monotonic()
            try:
                frame = await self.frame()
            except EngineDeadError:
                return
            if frame is not sent:
                yield frame
                sent = frame
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
