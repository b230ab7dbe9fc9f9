"""AsyncEngine: one engine loop in a background thread, many asyncio clients.

The HTTP handlers never run the model. They hand commands (add, abort, any callable)
to the engine thread, which runs them between steps, so the engine's state is only
ever touched by one thread (as vLLM's ``AsyncLLM`` keeps it in one core process)::

    handler --add/abort--> command queue --> [engine thread: commands, step(), dispatch]
       ^                                                            |
       +---- OutputSlot per request <----- call_soon_threadsafe ----+

Torch releases the GIL in its kernels: the event loop serves while a step runs. A client
that goes away is aborted at once, freeing its KV blocks in the next command round. At
most ``max_waiting`` requests wait for a first schedule; past that ``QueueFullError``.

The server sees the engine only through this class: facts fixed at load
(``tokenizer``, ``model_info``, ``routing_info``, read before the loop starts), the
``stats`` snapshot the loop publishes after every step, and methods that run on the
engine thread (``pin_prefix``, ``unpin_prefix``, ``reset_prefix_cache``, ``run``).
The ``LLMEngine`` itself is private: no HTTP thread reads the KV manager.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import RequestOutput, SamplingParams
from kvstack.engine.llm_engine import LLMEngine
from kvstack.engine.segments import automatic_segments
from kvstack.engine.stats import EngineStats
from kvstack.kv.base import KVRoutingInfo
from kvstack.kv.events import KVEvent
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.serve.api.request_log import RequestLog
from kvstack.serve.metrics.server import ServerMetrics
from kvstack.serve.output_stream import (
    OutputSlot,
    OutputStream,
    RequestInfo,
    StreamQueue,
    deliver,
)
from kvstack.serve.ui.kv_state import RecentRequests, build_state
from kvstack.serve.ui.prefix_view import PrefixTree, build_prefix_tree

logger = logging.getLogger("kvstack.serve")
LOG_INTERVAL_S = 10.0
STEP_ERROR_PREFIX = "internal error: "  # a RequestOutput.error from a failed model step
T = TypeVar("T")
Delivery = tuple[StreamQueue, RequestOutput]


class QueueFullError(Exception):
    """Too many requests are waiting; retry later."""


class EngineDeadError(Exception):
    """The engine loop stopped; no request can be served."""


@dataclass(frozen=True)
class ModelInfo:
    """The served model as ``/v1/models`` and ``/tokenize`` describe it (fixed at load)."""

    root: str  # what ``--model`` named: a path or "default"
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class PinResult:
    pinned_tokens: int
    num_pinned_blocks: int  # held by all pins, after this one


class AsyncEngine:
    """The server's handle on an ``LLMEngine`` (see the module docstring)."""

    def __init__(
        self,
        llm_engine: LLMEngine,
        *,
        max_waiting: int = 1024,
        metrics: ServerMetrics | None = None,
        request_log: str | None = None,
    ) -> None:
        # Touched only by the engine thread once it runs (``flush_offload`` aside: it
        # waits on the tiers' thread-safe queue).
        self._llm_engine = llm_engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._request_log = RequestLog(request_log) if request_log else None
        self.num_log_errors = 0  # metrics / request-log writes that failed (engine thread)
        self.recent = RecentRequests()  # the web view's last finished requests (engine thread)
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, StreamQueue] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._stop = False
        self._running = False
        self.stats: EngineStats = llm_engine.stats()
        self._thread = threading.Thread(target=self._run, name="kvstack-engine", daemon=True)
        self._last_log = time.monotonic()
        self._gen_tokens = 0
        self._logged_prefill = self.stats.prefill_tokens_computed
        self._loop_thread: threading.Thread | None = None  # set while the loop runs
        # Fixed at load, read here before the loop starts: safe from any thread after.
        self.tokenizer: Tokenizer = llm_engine.tokenizer
        self.model_info = ModelInfo(
            llm_engine.config.model, llm_engine.max_model_len, llm_engine.model_config.vocab_size
        )
        self.routing_info: KVRoutingInfo = llm_engine.routing_info()  # hash parameters
        # Segment reuse: whether chat requests' tools/documents/parts become segments.
        self.segments_enabled = automatic_segments(llm_engine)
        # Sampling defaults of fields a request leaves unset (``--generation-config``).
        self.generation_defaults: dict[str, Any] = dict(llm_engine.generation_defaults)

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
        if self._request_log is not None:
            self._request_log.close()

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
            self.call(lambda: self._llm_engine.abort_request(request_id))

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        info: RequestInfo,
        *,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        segments: Sequence[Sequence[Any]] | None = None,
    ) -> OutputStream:
        """Queue a request; returns the stream of its outputs.

        Raises ``InvalidRequestError`` (nothing queued), ``QueueFullError`` or
        ``EngineDeadError`` before anything is queued.
        """
        with self._lock:
            if self.stats.num_waiting + self._pending_adds >= self.max_waiting:
                if self.metrics is not None:
                    self.metrics.admission_rejections["max_num_queued_reqs"].inc()
                raise QueueFullError(f"{self.max_waiting} requests are already waiting")
            self._pending_adds += 1
        info.params = params
        info.salted = cache_salt is not None
        stream = StreamQueue(asyncio.get_running_loop(), OutputSlot(), info)
        self._streams[request_id] = stream

        counted = [True]  # this request is in _pending_adds until the engine takes it

        def uncount() -> None:
            with self._lock:
                if counted[0]:
                    counted[0] = False
                    self._pending_adds -= 1

        def add() -> None:
            uncount()
            self._llm_engine.add_request(
                request_id, None, params, prompt_token_ids=prompt_token_ids,
                cache_salt=cache_salt, segments=segments,
            )  # fmt: skip

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
        return OutputStream(self.abort, request_id, stream, timeout_s)

    # ------------------------------------------------------------------ server queries
    async def pin_prefix(self, token_ids: list[int], cache_salt: str | None) -> PinResult:
        """Compute a prefix if it is not cached, then pin its full blocks.

        ``InvalidRequestError`` (nothing computed, nothing pinned) when no prefix that
        long can be pinned: too short, too long for the pin budget, no prefix cache.
        """
        eng = self._llm_engine
        await self.run(lambda: eng.check_pinnable(len(token_ids)))
        stream = await self.add(
            f"pin-{uuid.uuid4().hex}", token_ids, SamplingParams(max_tokens=1),
            RequestInfo("pin"), cache_salt=cache_salt,
        )  # fmt: skip
        await stream.final()
        pinned, held = await self.run(
            lambda: (eng.pin_prefix(token_ids, cache_salt), eng.num_pinned_blocks())
        )
        return PinResult(pinned, held)

    async def unpin_prefix(self, token_ids: list[int], cache_salt: str | None) -> bool:
        """Release a pin; False if that prefix was not pinned."""
        return await self.run(lambda: self._llm_engine.unpin_prefix(token_ids, cache_salt))

    async def pin_cached(self, ids: list[int], salt: str | None, share: float) -> int:
        """Softly pin the cached blocks of ``ids`` (``KVCacheManager.pin_cached_prefix``)."""
        return await self.run(lambda: self._llm_engine.pin_cached_prefix(ids, salt, share))

    async def reset_prefix_cache(self) -> None:
        await self.run(self._llm_engine.reset_prefix_cache)

    async def flush_offload(self, timeout_s: float) -> bool:
        """Wait (in a worker thread, not the engine's) until the offload tiers hold every
        queued store; True at once without tiers, False on timeout."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._llm_engine.flush_offload, timeout_s)

    def subscribe_kv_events(self, fn: Callable[[KVEvent], None]) -> None:
        """Call ``fn`` with every KV event, on the engine thread (device cache) or the
        tiers' I/O thread, under the event log's lock: one order for all subscribers."""
        self._llm_engine.kv_events.subscribe(fn)

    def held_block_hashes(self) -> dict[str, list[bytes]]:
        """Each medium's cached block hashes (``LLMEngine.held_block_hashes``). Engine
        thread only: call it inside ``run`` / ``call``."""
        assert threading.current_thread() is self._loop_thread, "engine thread only"
        return self._llm_engine.held_block_hashes()

    def held_segment_keys(self) -> list[bytes]:
        """Ready segment entries' keys (``LLMEngine.held_segment_keys``). Engine thread."""
        assert threading.current_thread() is self._loop_thread, "engine thread only"
        return self._llm_engine.held_segment_keys()

    def kv_state(self, max_cells: int) -> dict[str, Any]:
        """The web view's snapshot (``serve/ui/kv_state.py``). Engine thread only."""
        assert threading.current_thread() is self._loop_thread, "engine thread only"
        return build_state(self._llm_engine, self.stats, self.recent, max_cells=max_cells)

    def prefix_tree(self, limit: int) -> PrefixTree:
        """The hottest cached prefixes (``serve/ui/prefix_view.py``). Engine thread only."""
        assert threading.current_thread() is self._loop_thread, "engine thread only"
        return build_prefix_tree(self._llm_engine, self.recent, limit)

    # ------------------------------------------------------------------ engine thread
    def _run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        logger.info("engine loop started")
        self._loop_thread = threading.current_thread()
        try:
            self._loop(keep_going)
        finally:
            self._running = False  # no command is queued from now on (``call``)
            self._drain()  # shutdown's aborts, queued while the last step ran: free blocks
            self._loop_thread = None
            logger.info("engine loop stopped")

    def _drain(self) -> None:
        """Run every queued command (``call``'s wrapper hands errors to the caller)."""
        while True:
            try:
                self._cmds.get_nowait()()
            except queue.Empty:
                return

    def _loop(self, keep_going: Callable[[], bool]) -> None:
        while not self._stop and keep_going():
            self._wake.clear()
            self._drain()
            if self._llm_engine.has_unfinished_requests():
                try:
                    outputs = self._llm_engine.step()
                    if self.metrics is not None:
                        self.metrics.on_step(self._llm_engine.scheduler.last_num_scheduled_tokens)
                except Exception as exc:  # a bug, not bad input: fail everyone, keep serving
                    logger.exception("engine step failed; aborting all requests")
                    self._count_internal()
                    self._fail_all(exc)
                    outputs = []
                now = time.monotonic()
                batches: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}
                for out in outputs:
                    item = self._dispatch(out, now)
                    if item is not None:
                        batches.setdefault(item[0].loop, []).append(item)
                # One wake-up of the event loop per step, not one per request.
                for loop, items in batches.items():
                    loop.call_soon_threadsafe(deliver, items)
                self._snapshot()
            else:
                self._snapshot()
                if self._cmds.empty():
                    self._wake.wait(0.5)

    def _snapshot(self) -> None:
        kv = self._llm_engine.kv_manager.stats()
        self.stats = s = self._llm_engine.stats(kv)
        if self.metrics is not None:
            self.metrics.update_engine(s, kv)
            if self._llm_engine.residency is not None:
                self.metrics.on_residency(self._llm_engine.residency.drain())
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

    def _dispatch(self, out: RequestOutput, now: float) -> Delivery | None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return None
        info = stream.info
        n = sum(len(c.token_ids) for c in out.outputs)
        new = n - info.num_tokens
        if new > 0 and self.metrics is not None:
            self.metrics.on_tokens(out, info, new, now)
        if new > 0:
            self._gen_tokens += new
            info.first_token = info.first_token or now
            info.last_token = now
            info.num_tokens = n
        if out.finished:
            self._streams.pop(out.request_id, None)
            if out.error is not None and out.error.startswith(STEP_ERROR_PREFIX):
                self._count_internal()  # step_isolation: the request made its step raise
            self._finish(out, info, now)
        return stream, out

    def _count_internal(self) -> None:
        if self.metrics is not None:
            self.metrics.internal_errors.labels("step").inc()

    def _finish(self, out: RequestOutput, info: RequestInfo, now: float) -> None:
        """Metrics and the request log of a finished request. Never raises: a failing
        log write (a full disk) must not stop the engine loop or lose the output."""
        reason = out.outputs[0].finish_reason if out.outputs else None
        try:
            last = info.last_token or now
            self.recent.add(
                out, info.endpoint, info.first_token, last, info.arrival, reason, info.salted
            )
            if self.metrics is not None:
                self.metrics.on_finished(out, info, now, reason or "error")
            if self._request_log is not None:
                self._request_log.write(out, info, now, reason)
        except Exception as e:
            self.num_log_errors += 1
            log = logger.exception if self.num_log_errors == 1 else logger.warning
            log("recording finished request %s failed (%d so far): %s", out.request_id,
                self.num_log_errors, e)  # fmt: skip

    def _fail_all(self, exc: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self._streams.pop(rid, None)
            stream.loop.call_soon_threadsafe(stream.slot.put, exc)
            try:
                self._llm_engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
