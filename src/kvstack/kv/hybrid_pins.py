"""Pins under the hybrid KV manager (``kv/hybrid.py``; ``/v1/cache/pin``, ``LLM.pin_prefix``).

A pin holds every page a hit of the whole pinned prefix needs: every block of a full-attention
group, the last window's blocks of a window group (``GroupedHits.hit_blocks``), so that hit
always happens; shorter hits of a window group are not held. Pins count against
``max_pinned_fraction`` of the pages; releasing them is ``PagedCommon``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstack.core.errors import InvalidRequestError
from kvstack.kv.base import cdiv
from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.kv.hashing import BlockHash, root_hash
from kvstack.kv.hybrid_cache import GroupedHashCache
from kvstack.kv.hybrid_radix import GroupedRadixCache


class HybridPins:
    """Mixin of ``HybridKVManager``: the attributes below are the manager's."""

    block_size: int
    model_id: str
    windows: tuple[int | None, ...]
    max_pinned_fraction: float
    cache: GroupedHashCache | GroupedRadixCache | None
    pool: BlockPool
    null: KVCacheBlock
    pins: dict[BlockHash, list[KVCacheBlock]]

    if TYPE_CHECKING:  # the manager's (``HybridKVManager``, ``PagedCommon``)

        @property
        def num_blocks(self) -> int: ...

        def prefix_hashes(
            self, token_ids: Sequence[int], cache_salt: str | None
        ) -> list[BlockHash]: ...

        def _hold_pin(self, last: BlockHash, blocks: list[KVCacheBlock]) -> None: ...

    def check_pinnable(self, num_tokens: int) -> None:
        """A pin needs a prefix cache, one full block, and at most ``max_pinned_fraction``
        of the pages (every block of a full group, a window's worth of a window group)."""
        if self.cache is None:
            raise InvalidRequestError("pinning needs a prefix cache (--prefix-cache hash)")
        bs, n = self.block_size, num_tokens // self.block_size
        if n < 1:
            raise InvalidRequestError(
                f"a pinned prefix needs at least one full block ({bs} tokens)"
            )
        need = sum(n if w is None else min(n, cdiv(w - 1, bs) + 1) for w in self.windows)
        limit = int(self.max_pinned_fraction * self.num_blocks)
        if need > limit:
            raise InvalidRequestError(
                f"a prefix of {num_tokens} tokens needs {need} pages; pins may hold at most "
                f"{limit} (max_pinned_fraction {self.max_pinned_fraction} of {self.num_blocks})"
            )

    def pin_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, max_fraction: float
    ) -> int:
        """No soft pins with KV groups (a window group's pages of a partial hit are not
        one chain): a stored conversation's next turn relies on the prefix cache alone."""
        return 0

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Hold every page a hit of the whole prefix needs (every block of a full group,
        the last window's blocks of a window group), so that hit always happens; shorter
        hits of a window group are not held. ``InvalidRequestError`` as the plain
        manager's ``pin_prefix``."""
        self.check_pinnable(len(token_ids))
        assert self.cache is not None
        hashes = self.prefix_hashes(token_ids, cache_salt)
        if hashes[-1] in self.pins:
            return len(hashes) * self.block_size
        root = root_hash(self.model_id, cache_salt)
        length = self.cache.hit_length(hashes, len(hashes), token_ids, root)
        if length < len(hashes):
            raise InvalidRequestError(
                f"only {length * self.block_size} of the prefix's "
                f"{len(hashes) * self.block_size} block-aligned tokens are cached in every "
                "KV group; run the prefix through the engine before pinning it"
            )
        tables = self.cache.hit_blocks(hashes, length, self.null, token_ids, root)
        blocks = [b for t in tables for b in t if b is not self.null]
        self._hold_pin(hashes[-1], blocks)
        return len(hashes) * self.block_size
