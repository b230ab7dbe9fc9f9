"""The task lifecycle both event followers share (``events_client``, ``events_zmq``).

A follower owns one asyncio task running its ``_run()`` loop. Invariants: at most one
task at a time (``start`` is idempotent), ``stop`` waits for the task to end and leaves
``connected`` False, and ``fresh`` is the index's word, never the follower's: what the
index holds for a replica is trusted only while the index says so.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from typing import Protocol


class FreshnessIndex(Protocol):
    def is_fresh(self, replica_id: str) -> bool: ...


class FollowerTask(ABC):
    """Base of an event follower: one named task running ``_run``."""

    replica_id: str
    index: FreshnessIndex
    task_prefix: str = "kv-events"
    _task: asyncio.Task[None] | None = None
    connected: bool = False

    @abstractmethod
    async def _run(self) -> None:
        """Follow the backend until cancelled (reconnecting as the follower decides)."""

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def fresh(self) -> bool:
        return self.index.is_fresh(self.replica_id)

    def start(self) -> None:
        """Start following (idempotent); needs a running event loop."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"{self.task_prefix}:{self.replica_id}"
            )

    async def stop(self) -> None:
        """Cancel the loop and wait for it to end (the index is left as it is)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.connected = False
