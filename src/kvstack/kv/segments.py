"""SegmentCache: the standalone KV of prompt segments, reused at any offset (issue 18).

Prefix caching only helps requests that share a *prefix*; agents send the same tool
schemas in different subsets and orders, RAG the same documents after different
questions. A segment's KV is therefore kept under the hash of its own tokens (and the
namespace: model and cache salt), not of what precedes it (EPIC, Hu et al., ICML 2025:
position-independent context caching; CacheBlend, Yao et al., EuroSys 2025).

An entry is computed once *standalone*: the scheduler runs ``[sink][segment]`` as its
own sequence at positions ``0 .. s + L - 1`` into blocks the entry owns (``s`` sink
tokens: the tokenizer's BOS, the attention sink of StreamingLLM). A request holding the
segment at positions ``a .. a + L - 1`` gets a copy with the keys re-rotated from
position ``s + i`` to ``a + i`` (``model/segment_rows.py``: RoPE is a rotation), so
requests never share an entry's blocks; they copy from them::

    entry (bs 4, s 1):  [S x0 x1 x2][x3 x4 . .]          positions 0 .. 5
    request:            [p0 p1 p2 x0][x1 x2 x3 x4][q0 ...]   x at 3 .. 7: rotate by +2

Blocks: an entry holds one reference on each of its ``ceil((s + L) / bs)`` blocks; they
are never in the prefix cache. Entries are evicted least recently used when the pool
needs blocks (``release``) or the entries would hold more than ``max_fraction`` of it;
an entry that is still being computed (pending) or that an admitted request has not
copied yet (``users > 0``) is never evicted, so a request's result never depends on
what the pool did between its admission and its copy.

Invariants (``check_integrity``): each entry holds exactly its blocks, each with
``ref_cnt >= 1`` and no prefix hash; ``users >= 0``; the entries' blocks are distinct
and number ``num_blocks``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.kv.hashing import DIGEST_SIZE, hash_block

SegmentKey = bytes
LOADING = "loading"  # an offload-tier lookup of a segment is still running (kv/tiers/)


def segment_key(namespace: bytes, token_ids: Sequence[int]) -> SegmentKey:
    """The key of a segment: its tokens under ``namespace`` (model, salt, sink)."""
    return hash_block(namespace, token_ids)


def segment_namespace(model_id: str, salt: str | None, sink: Sequence[int]) -> bytes:
    """What two requests must share to reuse each other's segments."""
    h = blake2b(digest_size=DIGEST_SIZE, person=b"kvstack-segment")
    h.update(model_id.encode() + b"\x00")
    if salt is not None:
        h.update(b"salt:" + salt.encode() + b"\x00")
    h.update(repr(list(sink)).encode())
    return h.digest()


@dataclass(eq=False)
class SegmentEntry:
    key: SegmentKey
    num_tokens: int  # segment tokens (the sink not counted)
    blocks: list[KVCacheBlock]
    ready: bool = False  # False until the step that computes it has run
    users: int = 0  # admitted requests that have not copied it yet


@dataclass
class SegmentCounters:
    """Token counts of ``kvstack:segment_cache_*`` (queries and hits at admission)."""

    query_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0  # standalone prefills (the sink included)
    loaded_tokens: int = 0  # entries loaded from an offload tier instead
    recomputed_tokens: int = 0  # repair rows
    placed_tokens: int = 0  # tokens copied into requests
    evicted: int = 0


@dataclass
class SegmentCache:
    pool: BlockPool
    block_size: int
    sink: tuple[int, ...]
    max_fraction: float = 0.5
    entries: OrderedDict[SegmentKey, SegmentEntry] = field(default_factory=OrderedDict)
    counters: SegmentCounters = field(default_factory=SegmentCounters)

    @property
    def num_blocks(self) -> int:
        return sum(len(e.blocks) for e in self.entries.values())

    def blocks_for(self, num_tokens: int) -> int:
        return -(-(len(self.sink) + num_tokens) // self.block_size)

    def get(self, key: SegmentKey) -> SegmentEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def reserve(self, key: SegmentKey, num_tokens: int) -> SegmentEntry | None:
        """A new pending entry with its blocks, evicting idle entries for room; None when
        the pool cannot give the blocks now (nothing changes then)."""
        need = self.blocks_for(num_tokens)
        cap = int(self.max_fraction * self.pool.num_blocks)
        if need > cap:
            return None
        over = self.num_blocks + need - cap
        if over > 0 and self.release(over) < over:
            return None
        short = need - self.pool.num_free_blocks
        if short > 0 and self.release(short) < short:
            return None
        entry = SegmentEntry(key, num_tokens, self.pool.allocate(need))
        self.entries[key] = entry
        return entry

    def mark_ready(self) -> list[SegmentEntry]:
        """The step that computed the pending entries has run; returns them."""
        done = [e for e in self.entries.values() if not e.ready]
        for entry in done:
            entry.ready = True
        return done

    def drop_pending(self) -> None:
        """A failed step: entries it was computing hold nothing usable."""
        for key in [k for k, e in self.entries.items() if not e.ready]:
            self._drop(key)

    def evictable_blocks(self) -> int:
        return sum(len(e.blocks) for e in self.entries.values() if e.ready and not e.users)

    def release(self, num_blocks: int) -> int:
        """Evict idle entries, least recently used first, until ``num_blocks`` blocks
        went back to the pool or none is left; returns how many went back."""
        freed = 0
        for key in list(self.entries):
            if freed >= num_blocks:
                break
            entry = self.entries[key]
            if entry.ready and not entry.users:
                freed += len(entry.blocks)
                self._drop(key)
                self.counters.evicted += 1
        return freed

    def _drop(self, key: SegmentKey) -> None:
        entry = self.entries.pop(key)
        self.pool.free(reversed(entry.blocks))

    def reset(self) -> None:
        """Forget every entry (``/reset_prefix_cache``); requests that still meant to copy
        one compute that segment in place instead."""
        for key in list(self.entries):
            self._drop(key)

    def check_integrity(self) -> None:
        seen: set[int] = set()
        for key, entry in self.entries.items():
            assert entry.key == key, "entry filed under another key"
            assert entry.users >= 0, f"segment entry with {entry.users} users"
            assert len(entry.blocks) == self.blocks_for(entry.num_tokens), "entry block count"
            for b in entry.blocks:
                assert b.block_id not in seen, f"block {b.block_id} in two segment entries"
                assert b.ref_cnt >= 1 and b.block_hash is None, f"segment block {b.block_id}"
                seen.add(b.block_id)
