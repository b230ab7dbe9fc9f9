"""The paged KV block pool (vLLM PagedAttention; vLLM v1 ``block_pool.py``).

The device KV memory is cut into ``num_blocks`` fixed-size blocks of ``block_size``
token slots. This module is pure bookkeeping: which block ids are free, who holds
each block (a reference count), and an O(1) LRU queue of free blocks.

Invariants (checked by ``check_integrity``):

* every block is exactly one of: plain free (in the free queue, no hash), held
  (``ref_cnt > 0``), or cached-evictable (``ref_cnt == 0`` with a prefix hash, owned
  by the prefix cache); ``num_free + num_held == num_blocks``;
* no reference count is negative;
* the free queue is a well-formed doubly-linked list of exactly the free blocks.

The free queue is intrusive (``KVCacheBlock.prev_free`` / ``next_free``): O(1) popleft,
append and remove. Cached blocks do not sit in it (unlike vLLM v1, where one LRU queue
holds both): their eviction order belongs to a pluggable policy (``kv/policies.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvstack.kv.residency import BlockResidency


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of KV slots. Identity matters, so ``eq=False``."""

    block_id: int
    ref_cnt: int = 0
    # Hash of the block's tokens (full blocks only) when it holds reusable prefix KV.
    block_hash: bytes | None = None
    is_null: bool = False  # the hybrid manager's null page: never cached (vLLM's)
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    in_free_queue: bool = False


class FreeBlockQueue:
    """Doubly-linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head
        if block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        block.prev_free = self._tail
        block.next_free = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        assert block.in_free_queue, f"block {block.block_id} is not in the free queue"
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterable[KVCacheBlock]:
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def check_integrity(self) -> None:
        seen = 0
        prev: KVCacheBlock | None = None
        for block in self:  # type: ignore[attr-defined]
            assert block.in_free_queue, f"block {block.block_id} linked but not marked free"
            assert block.prev_free is prev, f"broken back link at block {block.block_id}"
            prev = block
            seen += 1
        assert prev is self._tail, "tail pointer does not end the list"
        assert seen == self.num_free_blocks, f"{seen} linked != {self.num_free_blocks} counted"


class BlockPool:
    """All KV blocks of one engine, with reference counts.

    A block with ``ref_cnt == 0`` is *available*: either plain free (in ``free_queue``)
    or cached and evictable (owned by the prefix cache, ordered by its eviction
    policy). ``allocate`` takes plain free blocks first and asks the cache to evict
    only for the shortfall (SGLang evicts on demand the same way); ``free`` hands a
    block that reaches zero back to the cache if it holds a prefix hash, else to the
    free queue's tail.
    """

    def __init__(
        self,
        num_blocks: int,
        cache: PrefixCacheLike | None = None,
        residency: BlockResidency | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cache = cache
        self.num_evicted_blocks = 0
        # Called with a block id when a block goes back to the free queue (its contents
        # are dead): KV codecs with per-block state (KIVI's residual) listen.
        self.on_plain_free: Callable[[int], None] | None = None
        # vLLM's --kv-cache-metrics: every handed-out block is an eviction of its last
        # use then an allocation; every touch an access (``kv/residency.py``).
        self.residency = residency

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can obtain: plain free plus evictable cached ones."""
        evictable = self.cache.num_evictable if self.cache is not None else 0
        return self.free_queue.num_free_blocks + evictable

    @property
    def num_held_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests or pins (0..1), vLLM's ``kv_cache_usage_perc``."""
        return self.num_held_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Return ``n`` blocks with ``ref_cnt == 1``; raises if fewer are available."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        out = []
        take = min(n, self.free_queue.num_free_blocks)
        for _ in range(take):
            out.append(self.free_queue.popleft())
        if take < n:
            assert self.cache is not None
            evicted = self.cache.evict(n - take)
            self.num_evicted_blocks += len(evicted)
            out.extend(evicted)
        for block in out:
            assert block.ref_cnt == 0 and block.block_hash is None
            block.ref_cnt = 1
            if self.residency is not None:
                self.residency.on_evicted(block.block_id)
                self.residency.on_allocated(block.block_id)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on cached blocks (a prefix hit or a pin)."""
        for block in blocks:
            if block.ref_cnt == 0:
                assert self.cache is not None and block.block_hash is not None
                self.cache.on_acquire(block)
            block.ref_cnt += 1
            if self.residency is not None:
                self.residency.on_accessed(block.block_id)

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero become available.

        Callers pass a request's blocks in reverse order so that the tail of a chain
        is evicted before its head (vLLM v1).
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None and self.cache is not None:
                    self.cache.on_release(block)
                else:
                    self.free_queue.append(block)
                    if self.on_plain_free is not None:
                        self.on_plain_free(block.block_id)

    def reclaim(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Return blocks the cache dropped (``ref_cnt == 0``, hash cleared) to the free queue."""
        for block in blocks:
            assert block.ref_cnt == 0 and block.block_hash is None
            self.free_queue.append(block)

    def check_integrity(self) -> None:
        self.free_queue.check_integrity()
        num_plain = 0
        num_cached_free = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count on block {block.block_id}"
            if block.in_free_queue:
                assert block.ref_cnt == 0, f"free block {block.block_id} has refs"
                assert block.block_hash is None, f"free block {block.block_id} keeps a hash"
                num_plain += 1
            elif block.ref_cnt == 0:
                assert block.block_hash is not None, (
                    f"block {block.block_id} neither free, held nor cached"
                )
                num_cached_free += 1
        assert num_plain == self.free_queue.num_free_blocks
        evictable = self.cache.num_evictable if self.cache is not None else 0
        assert num_cached_free == evictable, (
            f"{num_cached_free} cached unreferenced blocks but the cache counts {evictable} "
            "evictable"
        )
        if self.cache is not None:
            self.cache.check_integrity()


class PrefixCacheLike(Protocol):
    """What the pool needs from a prefix cache (``kv/prefix_cache.py``)."""

    @property
    def num_evictable(self) -> int: ...

    def evict(self, n: int) -> list[KVCacheBlock]: ...

    def on_acquire(self, block: KVCacheBlock) -> None: ...

    def on_release(self, block: KVCacheBlock) -> None: ...

    def check_integrity(self) -> None: ...
