"""Era 2: the paged KV block pool (vLLM PagedAttention; vLLM v1 ``block_pool.py``).

The device KV memory is cut into ``num_blocks`` fixed-size blocks of ``block_size``
token slots. This module is pure bookkeeping: which block ids are free, who holds
each block (a reference count), and an O(1) LRU queue of free blocks.

Invariants (checked by ``check_integrity``):

* every block is either in the free queue (``ref_cnt == 0``) or held (``ref_cnt > 0``),
  never both; ``num_free + num_held == num_blocks``;
* no reference count is negative;
* the free queue is a well-formed doubly-linked list of exactly the free blocks.

The free queue is intrusive (``KVCacheBlock.prev_free`` / ``next_free``), so removing a
block from the middle (when a cached block is reused, era 3) costs O(1). Blocks are
allocated from the head; freed blocks are appended at the tail, so the head holds the
least recently freed block (LRU eviction order).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block of KV slots. Identity matters, so ``eq=False``."""

    block_id: int
    ref_cnt: int = 0
    # Hash of the block's tokens (full blocks only) when it holds reusable prefix KV (era 3).
    block_hash: bytes | None = None
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

    ``allocate`` hands out blocks with ``ref_cnt == 1``; ``free`` decrements and returns
    blocks that reach zero to the free queue's tail.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1), vLLM's ``kv_cache_usage_perc``."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue; raises if fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            block.block_hash = None
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero become free.

        Callers pass a request's blocks in reverse order so that the tail of a chain
        is evicted before its head (vLLM v1).
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        self.free_queue.check_integrity()
        num_free = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count on block {block.block_id}"
            if block.in_free_queue:
                assert block.ref_cnt == 0, f"free block {block.block_id} has refs"
                num_free += 1
            else:
                assert block.ref_cnt > 0, f"block {block.block_id} neither free nor held"
        assert num_free == self.num_free_blocks
