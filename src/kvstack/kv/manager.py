"""KVCacheManager: which blocks each request holds (vLLM v1 ``kv_cache_manager.py``).

The scheduler asks ``allocate_slots(request, num_new_tokens)`` before scheduling a
request's tokens; the manager grows the request's block table so it covers
``num_computed_tokens + num_new_tokens`` slots, or returns None (and changes nothing)
when the pool is too small, so the scheduler can preempt someone and retry.

Block table of a request with block_size 4 after computing 10 tokens::

    slots:   [0 1 2 3][4 5 6 7][8 9 . .]
    blocks:   b17      b3       b42        <- block_ids, logical order
                                   ^ 2 slots still free in the last block
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    usage: float  # 0..1
    num_requests: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits in an otherwise empty pool."""
        return self.num_blocks_for(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Ensure slots for ``request.num_computed_tokens + num_new_tokens`` tokens.

        Returns the request's whole block-id table, or None when there are not enough
        free blocks (nothing is allocated in that case).
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if needed > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        return [b.block_id for b in blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def free(self, request: Request | str) -> None:
        """Release all blocks of a request (tail first). Idempotent."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_blocks.pop(rid, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            usage=self.pool.usage,
            num_requests=len(self.req_blocks),
        )

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{held.get(block.block_id, 0)} request references"
            )
