"""KV block residency samples: vLLM's ``--kv-cache-metrics`` (``vllm/v1/core/kv_cache_metrics.py``).

A sampled block (each allocation is sampled with probability ``sample_rate``) records
its allocation time, its last access and its last four accesses (prefix hits). When
the pool hands the block out again (vLLM calls that its eviction, whether or not the
block held a cached prefix) the collector emits one ``ResidencySample``:

* ``lifetime_s``: allocation to eviction (``vllm:kv_block_lifetime_seconds``);
* ``idle_s``: last access (the allocation if none) to eviction
  (``vllm:kv_block_idle_before_evict_seconds``);
* ``reuse_gaps_s``: the gaps between consecutive accesses of the last four
  (``vllm:kv_block_reuse_gap_seconds``; an access list starts empty, so a block hit
  once has no gap, as in vLLM).

``reset`` (the prefix cache was reset) forgets every sampled block, as vLLM does.
Samples wait in a list until ``drain`` (the server, after every step) takes them; the
list holds at most ``max_pending`` (older ones are dropped and counted in
``num_dropped``) so an engine nobody scrapes cannot grow it. Engine thread only.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

ACCESS_HISTORY = 4  # vLLM's deque(maxlen=4)


@dataclass(frozen=True)
class ResidencySample:
    lifetime_s: float
    idle_s: float
    reuse_gaps_s: tuple[float, ...]


@dataclass
class _Block:
    born_ns: int
    last_access_ns: int
    accesses: deque[int] = field(default_factory=lambda: deque(maxlen=ACCESS_HISTORY))


class BlockResidency:
    """Samples block lifetimes, idle times and reuse gaps (see the module docstring)."""

    def __init__(
        self,
        sample_rate: float = 0.01,
        *,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        rng: Callable[[], float] = random.random,
        max_pending: int = 100_000,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._clock = clock_ns
        self._rng = rng
        self.max_pending = max_pending
        self._blocks: dict[int, _Block] = {}
        self._pending: deque[ResidencySample] = deque(maxlen=max_pending)
        self.num_dropped = 0

    def on_allocated(self, block_id: int) -> None:
        if self._rng() < self.sample_rate:
            now = self._clock()
            self._blocks[block_id] = _Block(now, now)

    def on_accessed(self, block_id: int) -> None:
        b = self._blocks.get(block_id)
        if b is not None:
            b.last_access_ns = now = self._clock()
            b.accesses.append(now)

    def on_evicted(self, block_id: int) -> None:
        b = self._blocks.pop(block_id, None)
        if b is None:
            return
        now = self._clock()
        acc = list(b.accesses)
        gaps = tuple((acc[i] - acc[i - 1]) / 1e9 for i in range(1, len(acc)))
        if len(self._pending) == self.max_pending:
            self.num_dropped += 1  # the deque drops the oldest
        self._pending.append(
            ResidencySample((now - b.born_ns) / 1e9, (now - b.last_access_ns) / 1e9, gaps)
        )

    def reset(self) -> None:
        """The cache was reset: forget the sampled blocks and the unread samples."""
        self._blocks.clear()
        self._pending.clear()

    def drain(self) -> list[ResidencySample]:
        out = list(self._pending)
        self._pending.clear()
        return out

    @property
    def num_tracked(self) -> int:
        return len(self._blocks)
