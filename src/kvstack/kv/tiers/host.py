"""Host tier: blocks in process RAM under a byte budget (vLLM's CPU offloading, SGLang
HiCache's host pool).

On a GPU server this is the pinned host memory that evicted device blocks fall back to.
On a CPU-only machine device and host memory are the same RAM, so this tier is simply
a second, larger and cheaper-to-grow pool: it holds *more* blocks than the device pool
(whose size also bounds the running batch), in the same bytes, and never holds blocks
the engine is computing. Payloads are kept as immutable ``bytes`` (no checksum: they
never leave the process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvstack.kv.tiers.base import OffloadTier
from kvstack.kv.tiers.block_format import BlockLayout
from kvstack.kv.tiers.budget import BlockBudget


class HostTier(OffloadTier):
    kind = "host"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, policy: str = "lru") -> None:
        super().__init__(layout)
        self.budget = BlockBudget(capacity_bytes, policy)
        self.data: dict[bytes, bytes] = {}

    def describe(self) -> str:
        cap = self.budget.capacity_bytes
        return f"host ({cap / 2**20:.0f} MiB, {cap // self.layout.payload_bytes} blocks)"

    def lookup_load(self, hashes: Sequence[bytes]) -> list[bytes]:
        t0 = time.perf_counter()
        out = []
        for h in hashes:
            payload = self.data.get(h)
            if payload is None:
                self.stats.misses += 1
                break
            self.budget.hit(h)
            out.append(payload)
        return self.stats.record_load(out, t0)

    def store(self, block_hash: bytes, payload: bytes) -> None:
        if block_hash in self.data:
            return
        if not self.budget.fits(len(payload)):
            self.stats.dropped_stores += 1
            return
        for victim in self.budget.admit(block_hash, len(payload)):
            del self.data[victim]
            self.stats.evictions += 1
        self.data[block_hash] = payload
        self.stats.stores += 1
        self.stats.bytes_stored += len(payload)
        self.stats.num_blocks = len(self.data)
        self.stats.used_bytes = self.budget.used_bytes

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.data

    def held_hashes(self) -> list[bytes] | None:
        return list(self.data)

    def watch_evictions(self, callback: Callable[[list[bytes]], None]) -> None:
        self.budget.on_evict = callback

    def check_integrity(self) -> None:
        super().check_integrity()
        self.budget.check_integrity()
        assert set(self.data) == set(self.budget.sizes), "host data and budget disagree"
