"""What the two paged KV managers share: ``KVCacheManager`` (one table for all layers,
``kv/manager.py``) and ``HybridKVManager`` (one table per KV group, ``kv/hybrid.py``).

Hash chains of requests (vLLM v1's block hashes, ``kv/hashing.py``), routing info, the
prefix cache's published hashes, pins' release, a press's fresh blocks, the
``KVCacheStats`` snapshot and what an offload connector (KV tiers,
``kv/tiers/connector.py``) sees of either manager: a *logical block* ``i`` of a request
is the list of pages that hold its KV, one per KV group (one page for
``KVCacheManager``; ``None`` where a window group freed it). Plain Python, no
torch; the host class holds ``block_size``, ``model_id``, ``pool``, ``cache``, ``pins``,
the prefix counters and ``_new_cached``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import Request
from kvstack.kv.base import KVCacheStats, KVRoutingInfo
from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.kv.events import KVEventLog
from kvstack.kv.hashing import BlockHash, hash_blocks, root_hash

if TYPE_CHECKING:
    from kvstack.kv.prefix_cache import PrefixCache


class PagedCommon(abc.ABC):
    """Mixin of the paged managers (see the module docstring)."""

    block_unit = "KV blocks"
    block_size: int
    model_id: str
    events: KVEventLog
    pool: BlockPool
    cache: PrefixCache | None
    pins: dict[BlockHash, list[KVCacheBlock]]
    # Keys of ``pins`` that are soft (``KVCacheManager.pin_cached_prefix``), oldest first.
    soft_pins: dict[BlockHash, None]
    max_pinned_fraction: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    # While an offload connector tracks them: (hash, pages) of logical blocks made
    # reusable since it last looked (``track_new_cached_blocks``), for it to store.
    _new_cached: list[tuple[BlockHash, list[KVCacheBlock]]] | None = None

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

    @abc.abstractmethod
    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Blocks of the longest cached prefix (group 0's with KV groups)."""

    # ------------------------------------------------------------------ offload connector
    @abc.abstractmethod
    def admission_cost(
        self,
        request: Request,
        computed: Sequence[KVCacheBlock],
        num_external_blocks: int,
        num_new_tokens: int,
    ) -> int:
        """Pages of ``num_free_blocks`` that ``allocate_slots(request, num_new_tokens,
        computed, num_external_blocks)`` would take at admission (adopted hits included)."""

    @abc.abstractmethod
    def logical_pages(self, request_id: str, first: int, end: int) -> list[list[int | None]]:
        """Per logical block ``first <= i < end`` of the request, its page per KV group
        (None: not held, a window group's freed block)."""

    @abc.abstractmethod
    def page_keys(self, block_hash: BlockHash) -> list[BlockHash]:
        """The prefix-cache key of each page of the logical block ``block_hash``."""

    def track_new_cached_blocks(self) -> None:
        """Start recording blocks that become reusable (an offload connector stores them)."""
        if self._new_cached is None:
            self._new_cached = []

    def pop_new_cached_blocks(self) -> list[tuple[BlockHash, list[int]]]:
        """``(hash, page ids)`` of logical blocks made reusable since the last call whose
        every page is still cached under that hash."""
        new, self._new_cached = self._new_cached, []
        assert new is not None, "track_new_cached_blocks() was not called"
        return [
            (h, [b.block_id for b in pages])
            for h, pages in new
            if all(b.block_hash == k for b, k in zip(pages, self.page_keys(h), strict=True))
        ]

    def discard_new_cached_blocks(self) -> None:
        """A failed step: its blocks may be half written, so none of them is reported."""
        if self._new_cached is not None:
            self._new_cached.clear()

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
        key = self.prefix_hashes(token_ids, cache_salt)[-1]
        blocks = self.pins.pop(key, None)
        self.soft_pins.pop(key, None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    def release_pins(self) -> None:
        for blocks in self.pins.values():
            self.pool.free(reversed(blocks))
        self.pins.clear()
        self.soft_pins.clear()

    # ------------------------------------------------------------------ introspection
    def _hold_pin(self, last: BlockHash, blocks: list[KVCacheBlock]) -> None:
        """Pin ``blocks`` under the prefix's last hash, unless all pins would then hold more
        than ``max_pinned_fraction`` of the blocks (``InvalidRequestError``)."""
        pinned = {b.block_id for chain in self.pins.values() for b in chain}
        after = len(pinned | {b.block_id for b in blocks})
        limit = int(self.max_pinned_fraction * self.num_blocks)
        if after > limit:
            raise InvalidRequestError(
                f"pinning would hold {after} {self.block_unit}, over the limit of {limit} "
                f"(max_pinned_fraction {self.max_pinned_fraction} of {self.num_blocks})"
            )
        self.pool.touch(blocks)
        self.pins[last] = blocks

    def allocate_blocks(self, n: int) -> list[int] | None:
        """``n`` fresh held blocks (pages) outside any request (a press fills them), or
        None when the pool cannot give them (``kv/press/compact.py``)."""
        if n > self.pool.num_free_blocks:
            return None
        return [b.block_id for b in self.pool.allocate(n)]

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Give back blocks from ``allocate_blocks`` that were not adopted (tail first)."""
        self.pool.free(reversed([self.pool.blocks[i] for i in block_ids]))

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
