"""CPU work of the router's request path (tokenizing, chat templating) off its event loop.

The router's loop answers ``/health``, relays every stream and runs the health checks;
a chat template over a large body is seconds of CPU, and on the loop three such bodies
left ``/health`` unanswered for 47 s and a healthy backend was ejected. ``BoundedWorkers``
runs the work in a few threads with a bounded backlog: past ``max_backlog`` waiting jobs
a request gets the fallback at once (the router routes it by load, as it routes a body
it cannot parse), so a flood of expensive bodies costs routing quality, never liveness.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class BoundedWorkers:
    """``run(fn, fallback)``: ``fn()`` in a worker thread, or ``fallback`` when
    ``max_backlog`` jobs are already queued or running. Invariant: ``pending`` counts the
    jobs submitted and not finished, never above ``max_backlog``."""

    def __init__(self, workers: int, max_backlog: int, name: str) -> None:
        assert workers >= 1 and max_backlog >= workers, (workers, max_backlog)
        self.max_backlog = max_backlog
        self.pending = 0
        self.num_skipped = 0  # jobs answered with the fallback (backlog full)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)

    async def run(self, fn: Callable[[], T], fallback: T) -> T:
        with self._lock:
            if self.pending >= self.max_backlog:
                self.num_skipped += 1
                return fallback
            self.pending += 1

        def job() -> T:
            try:
                return fn()
            finally:
                with self._lock:
                    self.pending -= 1

        return await asyncio.get_running_loop().run_in_executor(self._pool, job)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
