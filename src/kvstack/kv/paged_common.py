"""What the two paged KV managers share: ``KVCacheManager`` (one table for all layers,
``kv/manager.py``) and ``HybridKVManager`` (one table per KV group, ``kv/hybrid.py``).

Hash chains of requests (vLLM v1's block hashes, ``kv/hashing.py``), routing info, the
prefix cache's published hashes, pins' release and the ``KVCacheStats`` snapshot. Plain
Python, no torch; the host class holds ``block_size``, ``model_id``, ``pool``, ``cache``,
``pins`` and the prefix counters.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstack.kv.base import KVCacheStats, KVRoutingInfo
from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.kv.hashing import BlockHash, hash_blocks, root_hash
from kvstack.request import Request

if TYPE_CHECKING:
    from kvstack.kv.prefix_cache import PrefixCache


class PagedCommon(abc.ABC):
    """Mixin of the paged managers (see the module docstring)."""

    block_unit = "KV blocks"
    block_size: int
    model_id: str
    pool: BlockPool
    cache: PrefixCache | None
    pins: dict[BlockHash, list[KVCacheBlock]]
    prefix_query_tokens: int
    prefix_hit_tokens: int

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self.cache is not None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_pinned_blocks(self) -> int:
        return len({b.block_id for chain in self.pins.values() for b in chain})

    @abc.abstractmethod
    def held_request_ids(self) -> list[str]:
        """Ids of the requests holding blocks (each manager keeps its own tables)."""

    def routing_info(self) -> KVRoutingInfo:
        return KVRoutingInfo(self.model_id, self.block_size, self.cache is not None)

    def cached_hashes(self) -> list[bytes]:
        """Hashes of every block the prefix cache publishes (KV events' snapshot)."""
        return self.cache.cached_hashes() if self.cache is not None else []

    # ------------------------------------------------------------------ hashing
    def root_of(self, request: Request) -> BlockHash:
        """Root of the request's hash chain (model id and cache salt)."""
        return root_hash(self.model_id, request.cache_salt)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of every full block of the request's tokens (extended lazily)."""
        have = request.block_hashes
        if len(have) < request.num_tokens // self.block_size:
            have.extend(
                hash_blocks(request.all_token_ids, self.block_size, self.root_of(request), have)
            )
        return have

    def prefix_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        return hash_blocks(token_ids, self.block_size, root_hash(self.model_id, cache_salt))

    # ------------------------------------------------------------------ pins
    def unpin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        """Release a pin made by ``pin_prefix``; returns False if it was not pinned."""
        if len(token_ids) < self.block_size:
            return False
        blocks = self.pins.pop(self.prefix_hashes(token_ids, cache_salt)[-1], None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    def release_pins(self) -> None:
        for blocks in self.pins.values():
            self.pool.free(reversed(blocks))
        self.pins.clear()

    # ------------------------------------------------------------------ introspection
    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=self.cache.num_cached_blocks if self.cache is not None else 0,
            num_pinned_blocks=self.num_pinned_blocks,
            usage=1.0 - self.num_free_blocks / self.num_blocks,
            num_requests=len(self.held_request_ids()),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            num_evicted_blocks=self.pool.num_evicted_blocks,
        )
