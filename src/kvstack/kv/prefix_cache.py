"""Prefix reuse: the ``PrefixCache`` protocol and the hash-chain cache (vLLM v1).

A prefix cache remembers which *full* blocks hold the KV of which token prefix, so a
new request whose prompt starts with the same tokens adopts those blocks instead of
recomputing them. Two implementations share this protocol:

* ``HashPrefixCache`` (here, vLLM v1's automatic prefix caching): a dict from the
  chained block hash (``kv/hashing.py``) to the block. Lookup walks the request's
  hash chain until the first miss.
* ``RadixPrefixCache`` (``kv/radix.py``, SGLang's RadixAttention): a token radix tree.

Life of a cached block (ref counts live on ``KVCacheBlock``; ``BlockPool`` calls the
cache when a count crosses zero)::

    allocate --> held by a request --insert()--> cached & held --free()--> cached & evictable
                                                     ^                          |
                                                     +------- hit: touch() -----+
                                                                                | evict()
                                                                   plain free <-+

The eviction *order* among evictable blocks is the policy's (LRU, LFU, adaptive;
``kv/policies.py``); policy keys are the block hashes, which stay stable across
eviction (ARC's ghost lists need that). A pinned prefix holds a reference like a
request does, so its blocks are never evictable.

Invariants (``check_integrity``): every cached block's ``block_hash`` is its key; a
cached block is an eviction candidate iff ``ref_cnt == 0`` (hash cache; the radix
cache further requires it to be a leaf's last block); the policy's candidates are
exactly those blocks.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from kvstack.kv.hashing import BlockHash
from kvstack.kv.policies import EvictionPolicy


class PrefixCache(abc.ABC):
    name: ClassVar[str]

    def __init__(self, block_size: int, policy: EvictionPolicy, events: KVEventLog) -> None:
        self.block_size = block_size
        self.policy = policy
        self.events = events

    @property
    def num_evictable(self) -> int:
        return len(self.policy)

    @property
    @abc.abstractmethod
    def num_cached_blocks(self) -> int: ...

    @abc.abstractmethod
    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the cache serves now (a KV-event stream's snapshot)."""

    @abc.abstractmethod
    def match(
        self, token_ids: Sequence[int], hashes: Sequence[BlockHash], root: BlockHash
    ) -> list[KVCacheBlock]:
        """Blocks holding the longest cached prefix of ``hashes`` (one per full block).

        ``token_ids`` and ``hashes`` describe the same sequence (``hashes[i]`` covers
        tokens ``[i*bs, (i+1)*bs)``); callers cap ``hashes`` to the blocks they may reuse.
        ``root`` is the chain's root hash (model id and salt): different roots never share.
        Changes no reference count.
        """

    @abc.abstractmethod
    def insert(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        root: BlockHash,
        cache_salt: str | None = None,
    ) -> None:
        """Make ``blocks[i]`` reusable as the KV of block ``i`` (``i < len(hashes)``).
        ``cache_salt`` (in ``root`` already) goes into the events of runs from block 0.

        The blocks are held by the caller; a null page (``is_null``, the hybrid
        manager's freed window block) is skipped and ends a run of events. Blocks already
        cached are skipped; a block whose prefix another block already serves stays
        uncached (a duplicate computed concurrently), and is simply freed later.
        """

    @abc.abstractmethod
    def on_release(self, block: KVCacheBlock) -> None:
        """``block`` (cached) lost its last reference."""

    @abc.abstractmethod
    def on_acquire(self, block: KVCacheBlock) -> None:
        """``block`` (cached, unreferenced) is being referenced again."""

    def evict(self, n: int) -> list[KVCacheBlock]:
        """Drop ``n`` evictable blocks, in the policy's order; return them (hash cleared)."""
        out: list[KVCacheBlock] = []
        removed: list[BlockHash] = []
        for _ in range(n):
            h = self.policy.victim()
            assert isinstance(h, bytes)
            self.policy.on_remove(h)
            block = self._detach(h)
            assert block.ref_cnt == 0 and block.block_hash == h
            block.block_hash = None
            out.append(block)
            removed.append(h)
        self._removed(removed)
        return out

    @abc.abstractmethod
    def _detach(self, block_hash: BlockHash) -> KVCacheBlock:
        """Unlink the victim ``block_hash`` from the index; return its block."""

    @abc.abstractmethod
    def _drop_all(self) -> list[KVCacheBlock]:
        """Forget every entry; return the unreferenced blocks (hash cleared)."""

    @abc.abstractmethod
    def forget(self, blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        """Drop the entries of ``blocks`` (held or not; uncached ones are skipped) whose
        KV can no longer be trusted (a failed step wrote them); their hashes are cleared
        and a ``BlockRemoved`` published. Returns the unreferenced ones for the pool's
        free queue; held ones go there when released."""

    def on_hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            assert block.block_hash is not None
            self.policy.on_hit(block.block_hash)

    def reset(self) -> list[KVCacheBlock]:
        """Forget everything; returns unreferenced blocks for the pool's free queue.

        Held blocks simply lose their hash and go to the free queue when released.
        """
        freed = self._drop_all()
        self.policy.clear()
        self.events.publish(AllBlocksCleared())
        return freed

    @abc.abstractmethod
    def check_integrity(self) -> None: ...

    # ------------------------------------------------------------------ helpers
    def _stored(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        first: int,
        last: int,
        cache_salt: str | None = None,
    ) -> None:
        """Publish a ``BlockStored`` for chain blocks ``first .. last - 1``."""
        if last <= first:
            return
        bs = self.block_size
        self.events.publish(
            BlockStored(
                block_hashes=list(hashes[first:last]),
                parent_block_hash=hashes[first - 1] if first > 0 else None,
                token_ids=list(token_ids[first * bs : last * bs]),
                block_size=bs,
                cache_salt=cache_salt if first == 0 else None,
            )
        )

    def _removed(self, hashes: list[BlockHash]) -> None:
        if hashes:
            self.events.publish(BlockRemoved(hashes))


class HashPrefixCache(PrefixCache):
    """vLLM v1's automatic prefix caching: ``{chained block hash: block}``.

    A middle block of a chain may be evicted before its descendants (they become
    unreachable and age out); tail-first release makes that rare under LRU. The 128-bit
    hash covers the whole prefix, so a hit is a true prefix match (``kv/hashing.py``).
    """

    name = "hash"

    def __init__(self, block_size: int, policy: EvictionPolicy, events: KVEventLog) -> None:
        super().__init__(block_size, policy, events)
        self.table: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_cached_blocks(self) -> int:
        return len(self.table)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self.table)

    def match(
        self, token_ids: Sequence[int], hashes: Sequence[BlockHash], root: BlockHash
    ) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        for h in hashes:
            block = self.table.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def insert(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        root: BlockHash,
        cache_salt: str | None = None,
    ) -> None:
        run_start = -1  # first block of the current run of newly stored blocks
        for i, h in enumerate(hashes):
            block = blocks[i]
            fresh = block.block_hash is None and not block.is_null and h not in self.table
            if fresh:
                block.block_hash = h
                self.table[h] = block
                self.policy.on_insert(h)
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._stored(token_ids, hashes, run_start, i, cache_salt)
                run_start = -1
        if run_start >= 0:
            self._stored(token_ids, hashes, run_start, len(hashes), cache_salt)

    def on_release(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        self.policy.on_release(block.block_hash)

    def on_acquire(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        self.policy.on_acquire(block.block_hash)

    def _detach(self, block_hash: BlockHash) -> KVCacheBlock:
        return self.table.pop(block_hash)

    def forget(self, blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        freed: list[KVCacheBlock] = []
        removed: list[BlockHash] = []
        for block in blocks:
            h = block.block_hash
            if h is None or self.table.get(h) is not block:
                continue
            self._detach(h)  # (a subclass unlinks what else it indexes: a token tree)
            self.policy.on_remove(h)  # held or candidate
            block.block_hash = None
            removed.append(h)
            if block.ref_cnt == 0:
                freed.append(block)
        self._removed(removed)
        return freed

    def _drop_all(self) -> list[KVCacheBlock]:
        freed = [b for b in self.table.values() if b.ref_cnt == 0]
        for block in self.table.values():
            block.block_hash = None
        self.table.clear()
        return freed

    def check_integrity(self) -> None:
        for h, block in self.table.items():
            assert block.block_hash == h, f"block {block.block_id} keyed by a stale hash"
            candidate = h in self.policy
            assert candidate == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but candidate={candidate}"
            )
        assert len(self.policy) == sum(1 for b in self.table.values() if b.ref_cnt == 0)
        self.policy.check_integrity()
