"""The hybrid KV manager's radix prefix cache (SGLang's RadixAttention with KV groups).

``--prefix-cache radix`` with sliding-window layers (``kv/hybrid.py``). Group 0 — a
full-attention group — lives in the token radix tree of ``kv/radix.py`` unchanged: matched
token by token, its pages held along a running request's whole path, evicted leaf tail
first. Every other group's pages are looked up by ``group_key`` (the block's chained hash
with the group appended, as in ``kv/hybrid_cache.py``) and are eviction candidates as soon
as nothing holds them, wherever they sit: a window group's request frees the pages that
fell out of its window while it decodes (the hybrid manager's saving), so they cannot wait
for the tree's leaf order. This is SGLang's split of full and sliding-window KV
(``SWARadixCache``: window KV of a node may be evicted while its full KV stays, a
"tombstone"), with the tombstone being a missing key::

    tree (group 0, tokens):  root ─ [b0 b1 b2 b3] ─┬─ [b4 b5]     request A
                                                   └─ [b4']        request B
    window group (W = 2 blocks): keys of b2 b3 b4 b5 cached, b0 b1 evicted
    a hit of 6 blocks needs group 0's b0..b5 (tree) and the window's b4 b5 (keys)

A hit is the fixpoint of ``GroupedHits.hit_length`` with group 0's length from the tree
(full: monotone). Only group 0's blocks reach KV events (``BlockStored`` with the tokens,
as the plain radix cache publishes). A model whose every layer slides (Mistral) has no
full group to hold the tree: ``kv/hybrid_window_radix.py`` serves it (a token tree with
tombstones, every page by key).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.events import KVEventLog
from kvstack.kv.hashing import BlockHash
from kvstack.kv.hybrid_cache import GroupedHits, tagged
from kvstack.kv.policies import EvictionPolicy
from kvstack.kv.radix import RadixPrefixCache


class GroupedRadixCache(GroupedHits, RadixPrefixCache):
    """Group 0 in the radix tree, the other groups' pages by key (see the module docstring).

    Invariants (``check_integrity``): the tree's (``RadixPrefixCache``'s) for group 0's
    pages; every keyed page has its key as ``block_hash`` and is a candidate iff
    unreferenced; the policy's candidates are exactly the tree's and the keyed ones.
    """

    def __init__(
        self,
        block_size: int,
        policy: EvictionPolicy,
        events: KVEventLog,
        windows: tuple[int | None, ...],
    ) -> None:
        assert windows[0] is None, "group 0 must be a full-attention group"
        RadixPrefixCache.__init__(self, block_size, policy, events)
        self.windows = windows
        self.table: dict[BlockHash, KVCacheBlock] = {}  # groups >= 1, by group_key
        self._keyed_unreferenced = 0

    def group0_blocks(
        self, hashes: Sequence[BlockHash], limit: int, token_ids: Sequence[int], root: BlockHash
    ) -> list[KVCacheBlock] | None:
        return self.match(token_ids, hashes[:limit], root)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.by_hash) + len(self.table)

    @property
    def num_evictable(self) -> int:
        return self._num_unreferenced + self._keyed_unreferenced

    # ------------------------------------------------------------------ protocol
    def insert(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        root: BlockHash,
        cache_salt: str | None = None,
    ) -> None:
        """Group 0's chain into the tree (with tokens); another group's keyed pages (the
        hybrid manager inserts one group per call, ``group_key`` keys, no tokens)."""
        if not hashes or not tagged(hashes[0]):
            super().insert(token_ids, hashes, blocks, root, cache_salt)
            return
        for h, block in zip(hashes, blocks, strict=True):
            if block.block_hash is None and not block.is_null and h not in self.table:
                block.block_hash = h
                self.table[h] = block
                self.policy.on_insert(h)

    def on_release(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if not tagged(block.block_hash):
            super().on_release(block)
            return
        self._keyed_unreferenced += 1
        self.policy.on_release(block.block_hash)

    def on_acquire(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if not tagged(block.block_hash):
            super().on_acquire(block)
            return
        self._keyed_unreferenced -= 1
        self.policy.on_acquire(block.block_hash)

    def _detach(self, block_hash: BlockHash) -> KVCacheBlock:
        if not tagged(block_hash):
            return super()._detach(block_hash)
        self._keyed_unreferenced -= 1
        return self.table.pop(block_hash)

    def forget(self, blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        """Group 0's pages as the tree forgets them (with the subtree below); another
        group's keyed pages one by one (no page's KV is computed from a keyed page of
        another position's entry: a later hit still needs group 0's)."""
        freed = super().forget([b for b in blocks if b.block_hash and not tagged(b.block_hash)])
        for block in blocks:
            h = block.block_hash
            if h is None or not tagged(h) or self.table.get(h) is not block:
                continue
            del self.table[h]
            self.policy.on_remove(h)  # held or candidate
            block.block_hash = None
            if block.ref_cnt == 0:
                self._keyed_unreferenced -= 1
                freed.append(block)
        return freed

    def _removed(self, hashes: list[BlockHash]) -> None:
        super()._removed([h for h in hashes if not tagged(h)])

    def _drop_all(self) -> list[KVCacheBlock]:
        freed = super()._drop_all()
        freed += [b for b in self.table.values() if b.ref_cnt == 0]
        for block in self.table.values():
            block.block_hash = None
        self.table.clear()
        self._keyed_unreferenced = 0
        return freed

    def _other_candidates(self) -> int:
        unreferenced = 0
        for h, block in self.table.items():
            assert tagged(h) and block.block_hash == h, f"page {block.block_id}: stale key"
            assert (h in self.policy) == (block.ref_cnt == 0), f"page {block.block_id}"
            unreferenced += block.ref_cnt == 0
        assert unreferenced == self._keyed_unreferenced, "keyed pages' count out of sync"
        return unreferenced
