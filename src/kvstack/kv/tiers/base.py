"""The offload tier protocol (after vLLM v1's ``OffloadingManager``).

A tier is a key-value store of whole KV blocks below the device pool, keyed by the
block's prefix hash (``kv/hashing.py``), whose values are the block payload in the
cache dtype (``block_format.py``). Tiers know nothing of requests or device blocks;
``OffloadManager`` (``manager.py``) calls them from its one I/O thread:

* ``lookup_load(hashes)``: payloads of the longest run ``hashes[0..k)`` it holds
  (stops at the first miss: a prefix is only useful up to its first hole);
* ``store(hash, payload)``: keep a block (may evict others to fit its budget);
* ``contains(hash)``: a cheap local test, used to skip storing what is already there;
* ``evict``: each tier's own policy when its budget is full (LRU/LFU, or Redis's
  ``maxmemory-policy``).

Faults never propagate: a tier that fails answers "miss" and counts it, so the engine
recomputes. ``TierStats`` are plain counters written by the I/O thread and read, without
locks, by the metrics scrape (a stale read is harmless).
"""

from __future__ import annotations

import abc
import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from kvstack.kv.tiers.block_format import BlockLayout

logger = logging.getLogger("kvstack.kv.tiers")

# Buckets (seconds) of the per-lookup load latency histogram.
LOAD_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class TierStats:
    """Counters of one tier (blocks and bytes); exported as ``kvstack:offload_*``."""

    hits: int = 0  # blocks found by lookups
    misses: int = 0  # lookups that stopped at a block the tier lacks
    stores: int = 0  # blocks written
    bytes_loaded: int = 0
    bytes_stored: int = 0
    evictions: int = 0  # blocks dropped to stay within the budget
    errors: int = 0  # failed operations (I/O error, timeout, connection refused)
    corrupt: int = 0  # blocks that failed their checksum/header test (then deleted)
    dropped_stores: int = 0  # stores skipped: writes disabled, tier down, queue full
    num_blocks: int = 0  # blocks held now (local tiers; Redis: stored by us, may expire)
    used_bytes: int = 0
    load_latency_counts: list[int] = field(
        default_factory=lambda: [0] * (len(LOAD_LATENCY_BUCKETS) + 1)
    )
    load_latency_sum: float = 0.0

    def snapshot(self) -> TierStats:
        """A copy to publish (the I/O thread keeps counting in the original)."""
        return replace(self, load_latency_counts=list(self.load_latency_counts))

    def record_load(self, payloads: list[bytes], t0: float) -> list[bytes]:
        """Count a lookup that found ``payloads`` (started at ``perf_counter() == t0``)."""
        self.hits += len(payloads)
        self.bytes_loaded += sum(len(p) for p in payloads)
        if payloads:
            self.observe_load(time.perf_counter() - t0)
        return payloads

    def observe_load(self, seconds: float) -> None:
        self.load_latency_counts[bisect.bisect_left(LOAD_LATENCY_BUCKETS, seconds)] += 1
        self.load_latency_sum += seconds


class OffloadTier(abc.ABC):
    """One storage tier below the device pool. Used from a single thread."""

    kind: ClassVar[str]  # "host", "disk", "redis": the metrics label

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout
        self.stats = TierStats()
        self.closed = False
        self._warned: set[str] = set()

    @property
    def name(self) -> str:
        return self.kind

    @abc.abstractmethod
    def lookup_load(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Payloads of ``hashes[0..k)`` for the largest ``k`` the tier holds in full."""

    @abc.abstractmethod
    def store(self, block_hash: bytes, payload: bytes) -> None:
        """Keep ``payload`` under ``block_hash`` (best effort; failures are counted)."""

    @abc.abstractmethod
    def contains(self, block_hash: bytes) -> bool:
        """Whether the tier (as far as it knows locally) holds ``block_hash``."""

    def describe(self) -> str:
        return self.name

    def held_hashes(self) -> list[bytes] | None:
        """Every hash the tier holds, for a KV-event snapshot; None when the tier cannot
        enumerate them cheaply (Redis: shared, expiring, evicted by the server)."""
        return None

    def watch_evictions(self, callback: Callable[[list[bytes]], None]) -> None:
        """Have ``callback`` told the hashes the tier evicts (tiers that can observe it)."""
        del callback  # a tier whose store evicts on its own (Redis) cannot say which

    def close(self) -> None:
        """Release connections and files (the data itself stays, for disk and Redis)."""
        self.closed = True

    def check_integrity(self) -> None:
        """Assert the tier's bookkeeping invariants (subclasses add their own)."""
        s = self.stats
        counts = (s.hits, s.misses, s.stores, s.evictions, s.errors, s.corrupt, s.num_blocks)
        assert min(counts) >= 0, f"{self.name} tier: negative counter in {s}"
        assert sum(s.load_latency_counts) <= s.hits, "more timed loads than block hits"

    def warn_once(self, key: str, message: str, *args: object) -> None:
        """Log a warning the first time ``key`` happens (until ``clear_warning(key)``)."""
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s tier: " + message, self.name, *args)

    def clear_warning(self, key: str, message: str | None = None) -> None:
        if key in self._warned:
            self._warned.discard(key)
            if message:
                logger.warning("%s tier: %s", self.name, message)
