"""Segment entries in the offload tiers (segment reuse, ``kv/segments.py``).

A segment entry's blocks are stored write-through, like prefix blocks, once the step
that computed them has run, under their own keys: ``H(segment key, block index)``
(the tiers add the model/dtype namespace and a checksum, as for every block). Before a
missing segment is computed standalone, the tiers are asked for all of its blocks; the
request waits for the lookup like a request waiting for prefix blocks. A complete hit is
copied into a fresh entry before the step that reads it runs; anything less is
computed (an entry is never half loaded)::

    miss on device ─> lookup(key) ─ loading ─> (I/O thread) ─> staged n of N blocks
                                                   n == N: entry written, ready
                                                   n <  N: standalone fill, then stored
"""

from __future__ import annotations

from dataclasses import dataclass, field
from hashlib import blake2b

from kvstack.kv.segments import LOADING, SegmentEntry, SegmentKey
from kvstack.kv.storage import KVStorage
from kvstack.kv.tiers.manager import OffloadManager, StagedLoad


def segment_block_keys(key: SegmentKey, num_blocks: int) -> list[bytes]:
    """The tier keys of an entry's blocks."""
    return [
        blake2b(key + j.to_bytes(4, "little"), digest_size=16, person=b"kvstack-segblk").digest()
        for j in range(num_blocks)
    ]


@dataclass
class SegmentTiers:
    offload: OffloadManager
    storage: KVStorage
    looked: set[SegmentKey] = field(default_factory=set)  # lookups submitted, not consumed
    num_loaded: int = 0  # entries loaded from a tier
    num_stored: int = 0  # entries submitted for storing

    @staticmethod
    def _rid(key: SegmentKey) -> str:
        return "segment:" + key.hex()

    def lookup(self, key: SegmentKey, num_blocks: int) -> StagedLoad | str | None:
        """``LOADING`` while the tiers are asked; then, once, the staged blocks if the
        tiers held all ``num_blocks`` of them, else None (compute it)."""
        rid = self._rid(key)
        if self.offload.is_loading(rid):
            return LOADING
        staged = self.offload.take(rid)
        if staged is not None:
            self.looked.discard(key)
            return staged if staged.num_blocks == num_blocks else None
        if key in self.looked:
            self.looked.discard(key)
            return None
        self.looked.add(key)
        self.offload.submit_load(rid, 0, segment_block_keys(key, num_blocks))
        return LOADING

    def write(self, entry: SegmentEntry, staged: StagedLoad) -> None:
        """Copy a complete staged entry into its blocks (before any step reads them)."""
        assert staged.num_blocks == len(entry.blocks), "an entry is never half loaded"
        for block, raw in zip(entry.blocks, staged.blocks, strict=True):
            self.storage.write_block(block.block_id, raw)
        self.num_loaded += 1

    def store(self, entries: list[SegmentEntry]) -> None:
        """Queue computed entries for every tier that lacks them (write-through)."""
        for entry in entries:
            keys = segment_block_keys(entry.key, len(entry.blocks))
            if all(self.offload.all_contain(k) for k in keys):
                continue
            data = self.storage.read_blocks([b.block_id for b in entry.blocks])
            if self.offload.submit_store(keys, data):
                self.num_stored += 1
