"""One request's outputs, from the engine thread to the asyncio handler that awaits them.

The engine thread never touches an asyncio object directly: it batches each step's
outputs per event loop and hands them over with ``call_soon_threadsafe(deliver, ...)``,
one wake-up per loop per step. Outputs are cumulative (each holds every token so far), so
a request keeps only its latest undelivered one (``OutputSlot``): a reader slower than the
engine gets fewer, bigger deltas, and memory per request stays one output however slowly
it reads (a queue of every step's output grew with tokens^2: 400 tokens x n=16 with
logprobs unread was 1.28 M queued token ids for one slow reader). The readers compute
their deltas from what they sent (``text_sent``, ``lp_sent``), never from the previous
output. The handler iterates an ``OutputStream``; leaving it
early (``close()``, a client disconnect, the deadline) aborts the request, which frees
its KV blocks in the engine's next command round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstack.core.request import RequestOutput, SamplingParams


class RequestTimeoutError(Exception):
    """The request ran past its deadline and was aborted."""


@dataclass
class RequestInfo:
    """What the request log and the metrics need to know about a request."""

    endpoint: str
    session_id: str | None = None
    arrival_wall: float = field(default_factory=time.time)
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    params: SamplingParams | None = None  # set when queued (``AsyncEngine.add``)
    salted: bool = False  # queued with a cache_salt (the web view never lists its prefix)


class OutputSlot:
    """The latest undelivered output of one request (event-loop side only).

    Invariants: holds at most one item; a newer output replaces an undelivered older one
    (``num_replaced`` counts them); an exception replaces anything and is never replaced,
    so a failure is always seen; ``get`` returns items in the order they were put.
    """

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.num_replaced = 0

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._item, BaseException):
            return
        if self._item is not None:
            self.num_replaced += 1
        self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        assert item is not None
        return item

    def pending(self) -> int:
        return 0 if self._item is None else 1


@dataclass
class StreamQueue:
    """Where the engine thread puts a request's outputs: the slot and the loop it belongs
    to (a ``BaseException`` in the slot fails the stream)."""

    loop: asyncio.AbstractEventLoop
    slot: OutputSlot
    info: RequestInfo


def deliver(items: list[tuple[StreamQueue, RequestOutput]]) -> None:
    """Runs on the slots' event loop (``call_soon_threadsafe``)."""
    for stream, out in items:
        stream.slot.put(out)


class OutputStream:
    """Async iterator over one request's outputs; ``close()`` (or an early exit) aborts it.

    Raises ``RequestTimeoutError`` (after aborting) when the deadline passes.
    """

    def __init__(
        self,
        abort: Callable[[str], None],
        request_id: str,
        stream: StreamQueue,
        timeout_s: float | None,
    ) -> None:
        self._abort = abort
        self.request_id = request_id
        self._stream = stream
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self.finished = False

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        left = None if self._deadline is None else self._deadline - time.monotonic()
        try:
            if left is not None and left <= 0:
                raise TimeoutError
            item = await asyncio.wait_for(self._stream.slot.get(), left)
        except TimeoutError:
            self.close()
            raise RequestTimeoutError(f"request timed out after {self._timeout_s} s") from None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def final(self) -> RequestOutput:
        """Wait for the finished output."""
        last = None
        async for out in self:
            last = out
        assert last is not None and last.finished
        return last

    def close(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)
