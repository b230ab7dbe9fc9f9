"""Relay a committed backend response to the client, chunk by chunk.

Once a backend's first body byte has arrived the router is committed to that backend:
:func:`relay_response` streams the rest through a Starlette response as it arrives (the
client's pace backpressures the backend read). If the backend dies, or the health loop
ejects it (a hung replica), mid-response, an SSE response ends with a final
``data: {"error": ...}`` event and ``data: [DONE]`` (the server's own mid-stream error
shape) and a JSON response is cut off; it is never retried, since the client has already
seen part of it.

Invariants: SSE is relayed on event boundaries (``\\n\\n``), so the error event never
lands inside half an event; an event longer than ``MAX_SSE_HELD_BYTES`` is relayed as it
arrives instead (a backend streaming without blank lines was buffered whole: nothing
reached the client, ~150 MB held), and an error after such a partial event starts with a
blank line, so it is still an event of its own. ``release`` (the attempt's in-flight
count and connection) runs exactly once, even when the response is never iterated
(client gone first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstack.route.router.backends import Backend, BackendPool
from kvstack.route.router.metrics import RouterMetrics
from kvstack.serve.api.protocol import error_body

logger = logging.getLogger("kvstack.route")

FORWARD_RESPONSE_HEADERS = frozenset(
    {"content-type", "content-encoding", "retry-after", "x-request-id", "cache-control",
     "kvstack-ignored-fields"}  # serve/api/leniency.py: the body fields the replica ignored
)  # fmt: skip


MAX_SSE_HELD_BYTES = 1 << 20  # SSE bytes held back waiting for an event's end


def sse_error(message: str) -> bytes:
    """The closing events of a stream whose backend failed."""
    event = json.dumps(error_body(message, "server_error", code=502))
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


class RelayResponse(StreamingResponse):
    """A StreamingResponse that always calls ``release`` once, even if never iterated."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        release: Callable[[], None],
        status_code: int,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(body, status_code=status_code, headers=dict(headers))
        self._body = body
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self._release()


def relay_response(
    b: Backend,
    resp: aiohttp.ClientResponse,
    first: bytes,
    extra_headers: Mapping[str, str],
    pool: BackendPool,
    metrics: RouterMetrics,
) -> Response:
    """The client's response for ``resp`` (of backend ``b``), whose body began with
    ``first``; decrements ``b``'s in-flight count when it ends."""
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            b.replica.inflight -= 1
            resp.close()

    out = {k: v for k, v in resp.headers.items() if k.lower() in FORWARD_RESPONSE_HEADERS}
    out.update(extra_headers)
    sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    body = _relay(b, resp, first, sse, pool, metrics)
    return RelayResponse(body, release, resp.status, out)


async def _relay(
    b: Backend,
    resp: aiohttp.ClientResponse,
    first: bytes,
    sse: bool,
    pool: BackendPool,
    metrics: RouterMetrics,
) -> AsyncIterator[bytes]:
    pending = bytearray(first)
    down = asyncio.create_task(b.down.wait())
    read: asyncio.Task[bytes] | None = None
    mid_event = False  # what was relayed last ended inside an event (one over the cap)
    try:
        while True:
            cut = len(pending)
            if sse:  # whole events, unless one outgrows the cap
                end = pending.rfind(b"\n\n")
                cut = end + 2 if end >= 0 else 0
                if len(pending) - cut > MAX_SSE_HELD_BYTES:
                    cut = len(pending)
            if cut:
                mid_event = sse and not pending.endswith(b"\n\n", 0, cut)
                yield bytes(pending[:cut])
                del pending[:cut]
            read = asyncio.create_task(resp.content.readany())
            await asyncio.wait({read, down}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                raise ConnectionError("backend ejected by the health checks mid-response")
            chunk = read.result()
            if not chunk:
                if pending:
                    yield bytes(pending)
                return
            pending += chunk
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        metrics.stream_errors.inc()
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        logger.warning("backend %s failed mid-response (%s); not retried", b.id, why)
        pool.report_failure(b.id, f"mid-response: {why}")
        if not sse:
            raise
        closing = sse_error(f"backend {b.id} failed mid-response: {why}")
        yield b"\n\n" + closing if mid_event else closing
    finally:
        for t in (down, read):
            if t is not None:
                t.cancel()
        await asyncio.gather(down, *([read] if read else []), return_exceptions=True)
        resp.close()
