"""AsyncEngine: one engine loop in a background thread, many asyncio clients.

The HTTP handlers never run the model. They hand commands (add, abort, any callable)
to the engine thread, which runs them between steps, so the engine's state is only
ever touched by one thread (as vLLM's ``AsyncLLM`` keeps it in one core process)::

    handler --add/abort--> command queue --> [engine thread: commands, step(), dispatch]
       ^                                                            |
       +---- asyncio.Queue per request <-- call_soon_threadsafe ----+

Torch releases the GIL inside its kernels, so the event loop keeps accepting and
streaming while a step runs. Each step's outputs are routed to their request's queue;
a finished request's queue gets its last output and the stream ends. A client that
goes away is aborted at once, which frees its KV blocks in the next command round.

Admission control: at most ``max_waiting`` requests may wait for a first schedule;
past that ``add`` raises ``QueueFullError`` (the server answers 429).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstack.engine import LLMEngine
from kvstack.errors import InvalidRequestError
from kvstack.request import RequestOutput, SamplingParams
from kvstack.serve.metrics import ServerMetrics
from kvstack.stats import EngineStats

logger = logging.getLogger("kvstack.serve")
LOG_INTERVAL_S = 10.0
T = TypeVar("T")


class QueueFullError(Exception):
    """Too many requests are waiting; retry later."""


class RequestTimeoutError(Exception):
    """The request ran past its deadline and was aborted."""


class EngineDeadError(Exception):
    """The engine loop stopped; no request can be served."""


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


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    info: RequestInfo


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


class OutputStream:
    """Async iterator over one request's outputs; ``close()`` (or an early exit) aborts it.

    Raises ``RequestTimeoutError`` (after aborting) when the deadline passes.
    """

    def __init__(
        self, engine: AsyncEngine, request_id: str, stream: _Stream, timeout_s: float | None
    ) -> None:
        self._engine = engine
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
            item = await asyncio.wait_for(self._stream.queue.get(), left)
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
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting: int = 1024,
        metrics: ServerMetrics | None = None,
        request_log: str | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._log_file = open(request_log, "a", encoding="utf-8") if request_log else None  # noqa: SIM115
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._stop = False
        self._running = False
        self.stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="kvstack-engine", daemon=True)
        self._last_log = time.monotonic()
        self._gen_tokens = 0
        self._logged_prefill = self.stats.prefill_tokens_computed

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Run the engine loop in a background thread (tests, embedding in an app)."""
        self._running = True
        self._thread.start()

    def mark_running(self) -> None:
        """Accept commands now; ``run_forever`` (in the calling thread) will run them."""
        self._running = True

    def run_forever(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Run the engine loop in the calling thread until ``shutdown`` or ``keep_going()``
        turns false. ``kvstack serve`` calls this from the main thread: OpenMP keeps its
        worker threads spinning only for the process's first team, and a loop in a second
        thread measured ~25 % slower steps on 2 cores."""
        self._running = True
        self._run(keep_going)

    @property
    def alive(self) -> bool:
        return self._running and not self._stop

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Let running requests finish for up to ``grace_s``, abort the rest, stop."""
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.info("shutdown: aborting %d unfinished requests", len(self._streams))
            for rid in list(self._streams):
                self.abort(rid)
            await asyncio.sleep(0.1)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        if self._log_file is not None:
            self._log_file.close()

    # ------------------------------------------------------------------ commands
    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` in the engine thread between steps; returns a future of its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # delivered to the caller
                    fut.set_exception(exc)

        if not self.alive:
            fut.set_exception(EngineDeadError("the engine loop is not running"))
            return fut
        self._cmds.put(run)
        self._wake.set()
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent); its blocks are freed in the next command round."""
        self._streams.pop(request_id, None)
        if self.alive:
            self.call(lambda: self.engine.abort_request(request_id))

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        info: RequestInfo,
        *,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
    ) -> OutputStream:
        """Queue a request; returns the stream of its outputs.

        Raises ``InvalidRequestError`` (nothing queued), ``QueueFullError`` or
        ``EngineDeadError`` before anything is queued.
        """
        with self._lock:
            if self.stats.num_waiting + self._pending_adds >= self.max_waiting:
                raise QueueFullError(f"{self.max_waiting} requests are already waiting")
            self._pending_adds += 1
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), info)
        self._streams[request_id] = stream

        counted = [True]  # this request is in _pending_adds until the engine takes it

        def uncount() -> None:
            with self._lock:
                if counted[0]:
                    counted[0] = False
                    self._pending_adds -= 1

        def add() -> None:
            uncount()
            self.engine.add_request(
                request_id, None, params, prompt_token_ids=prompt_token_ids, cache_salt=cache_salt
            )

        try:
            await self.run(add)
        except InvalidRequestError:
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            uncount()  # e.g. the engine loop stopped before running the command
            # Cancelled while waiting: the add may still run; the abort queued after it
            # (commands run in order) then frees whatever it allocated.
            self.abort(request_id)
            raise
        return OutputStream(self, request_id, stream, timeout_s)

    # ------------------------------------------------------------------ engine thread
    def _run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        logger.info("engine loop started")
        try:
            self._loop(keep_going)
        finally:
            self._running = False
            logger.info("engine loop stopped")

    def _loop(self, keep_going: Callable[[], bool]) -> None:
        while not self._stop and keep_going():
            self._wake.clear()
            while True:
                try:
                    self._cmds.get_nowait()()
                except queue.Empty:
                    break
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug, not bad input: fail everyone, keep serving
                    logger.exception("engine step failed; aborting all requests")
                    self._fail_all(exc)
                    outputs = []
                now = time.monotonic()
                batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
                for out in outputs:
                    item = self._dispatch(out, now)
                    if item is not None:
                        batches.setdefault(item[0].loop, []).append(item)
                # One wake-up of the event loop per step, not one per request.
                for loop, items in batches.items():
                    loop.call_soon_threadsafe(_deliver, items)
                self._snapshot()
            else:
                self._snapshot()
                if self._cmds.empty():
                    self._wake.wait(0.5)

    def _snapshot(self) -> None:
        kv = self.engine.kv_manager.stats()
        self.stats = s = self.engine.stats(kv)
        if self.metrics is not None:
            self.metrics.update_engine(s, kv)
        now = time.monotonic()
        dt = now - self._last_log
        if dt >= LOG_INTERVAL_S and (s.num_running or s.num_waiting or self._gen_tokens):
            # vLLM-style periodic status line, so an operator sees what the server does.
            logger.info(
                "prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | "
                "KV usage %.1f%%, prefix hit rate %.1f%%, preemptions %d in total",
                (s.prefill_tokens_computed - self._logged_prefill) / dt,
                self._gen_tokens / dt,
                s.num_running,
                s.num_waiting,
                100 * s.kv_usage,
                100 * s.prefix_hit_rate,
                s.num_preemptions,
            )
            if s.offload:
                logger.info(
                    "KV tiers: %s",
                    ", ".join(
                        f"{name} {t.hits} hits / {t.stores} stores / {t.num_blocks} blocks"
                        + (f" / {t.errors} errors" if t.errors else "")
                        for name, t in s.offload.items()
                    ),
                )
            self._last_log, self._gen_tokens = now, 0
            self._logged_prefill = s.prefill_tokens_computed

    def _dispatch(self, out: RequestOutput, now: float) -> tuple[_Stream, RequestOutput] | None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return None
        info = stream.info
        n = sum(len(c.token_ids) for c in out.outputs)
        new = n - info.num_tokens
        if new > 0 and self.metrics is not None:
            if info.first_token is None:
                self.metrics.ttft.observe(now - info.arrival)
            elif info.last_token is not None:
                self.metrics.itl.observe(now - info.last_token)
        if new > 0:
            self._gen_tokens += new
            info.first_token = info.first_token or now
            info.last_token = now
            info.num_tokens = n
        if out.finished:
            self._streams.pop(out.request_id, None)
            self._finish(out, info, now)
        return stream, out

    def _finish(self, out: RequestOutput, info: RequestInfo, now: float) -> None:
        reason = out.outputs[0].finish_reason if out.outputs else None
        if self.metrics is not None:
            self.metrics.on_finished(out, now - info.arrival, reason or "error")
        if self._log_file is not None:
            record: dict[str, Any] = {
                "timestamp": info.arrival_wall,
                "request_id": out.request_id,
                "endpoint": info.endpoint,
                "session_id": info.session_id,
                "prompt_token_ids": out.prompt_token_ids,
                "num_prompt_tokens": len(out.prompt_token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "num_output_tokens": info.num_tokens,
                "ttft_s": None if info.first_token is None else info.first_token - info.arrival,
                "e2e_s": now - info.arrival,
                "finish_reason": reason,
            }
            self._log_file.write(json.dumps(record) + "\n")
            self._log_file.flush()

    def _fail_all(self, exc: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self._streams.pop(rid, None)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
