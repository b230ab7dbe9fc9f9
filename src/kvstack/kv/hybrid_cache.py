"""The hybrid KV manager's prefix cache: one hash cache, keys per KV group.

Every group's blocks live in one ``HashPrefixCache`` with one eviction policy, so LRU (or
LFU, ARC) orders all pages alike. Group 0 — a full-attention group when the model has
one — keys its blocks by the request's block hash as the plain manager does (so KV events
and the routers reading them see the same chain); every other group by the hash with the
group's number appended (17 bytes: never an event, never a plain hash). In a model
without a full-attention layer (Mistral) group 0 is a window group: its events name the
blocks it computed, and a block it evicted (``BlockRemoved``) may leave later blocks
that still serve hits (a window hit needs only its window), so a router reading the
events underestimates such hits, never overestimates them.

A hit of ``L`` blocks (vLLM v1's ``find_longest_cache_hit`` per manager type) needs every
block ``< L`` of a full group, and of a window group only the blocks a row at position
``L * block_size`` or later still reads, ``[first_live(L * bs), L)``::

    W = 8, bs 4, L = 5 (rows from 20 read keys >= 13):
    full group:    [h0][h1][h2][h3][h4]     all five cached
    window group:  [  ][  ][  ][h3][h4]     blocks 3 and 4 cached (0-2 may be evicted)

A window group's hits are not monotone in ``L`` (a shorter hit needs other blocks), so the
hit is a fixpoint: each group in turn shortens ``L`` to its own longest hit ``<= L``
until no group shortens it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.events import KVEventLog
from kvstack.kv.hashing import BlockHash, root_hash
from kvstack.kv.policies import EvictionPolicy
from kvstack.kv.prefix_cache import HashPrefixCache

HASH_LEN = len(root_hash())  # bytes of an untagged block hash


def first_live(window: int | None, position: int, block_size: int) -> int:
    """First block a row at ``position`` (or later) reads under ``window`` (None: 0)."""
    return 0 if window is None else max(0, position - window + 1) // block_size


def tagged(h: BlockHash) -> bool:
    """True for a key of a group other than 0 (never published)."""
    return len(h) != HASH_LEN


def group_key(group: int, h: BlockHash) -> BlockHash:
    """``group``'s key of the block whose plain hash is ``h`` (group 0: ``h`` itself)."""
    return h + bytes((group,)) if group else h


class GroupedHits:
    """The hit rules over per-group lookups, shared by the hash and the radix cache:
    ``longest`` per group, ``hit_length`` (the fixpoint) and ``hit_blocks``. Subclasses
    give ``group0_blocks`` (group 0's longest cached prefix, a full group in the radix
    cache) and ``table`` (``group_key``-keyed pages of the groups they look up by hash)."""

    windows: tuple[int | None, ...]
    block_size: int
    table: dict[BlockHash, KVCacheBlock]

    def key(self, group: int, h: BlockHash) -> BlockHash:
        return group_key(group, h)

    def group0_blocks(
        self, hashes: Sequence[BlockHash], limit: int, token_ids: Sequence[int], root: BlockHash
    ) -> list[KVCacheBlock] | None:
        """Group 0's pages of its longest hit of at most ``limit`` blocks, or None: group 0
        is looked up in ``table`` like the others."""
        return None

    def longest(self, group: int, hashes: Sequence[BlockHash], limit: int) -> int:
        """Longest hit ``L <= limit`` (in blocks) ``group`` serves from ``table``."""
        table, bs = self.table, self.block_size
        if self.windows[group] is None:
            n = 0
            while n < limit and self.key(group, hashes[n]) in table:
                n += 1
            return n
        length = limit
        while length > 0:
            j = length - 1
            first = first_live(self.windows[group], length * bs, bs)
            while j >= first and self.key(group, hashes[j]) in table:
                j -= 1
            if j < first:
                return length
            length = j  # every hit ending after block j needs it
        return 0

    def hit_length(
        self,
        hashes: Sequence[BlockHash],
        limit: int,
        token_ids: Sequence[int] = (),
        root: BlockHash = b"",
    ) -> int:
        """The longest hit of at most ``limit`` blocks every group serves (the fixpoint)."""
        first = self.group0_blocks(hashes, limit, token_ids, root)
        length = limit if first is None else len(first)
        changed = True
        while changed and length > 0:
            changed = False
            for g in range(len(self.windows)):
                if g == 0 and first is not None:
                    continue  # a full group's hits are monotone: len(first) bounds them all
                got = self.longest(g, hashes, length)
                changed |= got < length
                length = got
        return length

    def hit_blocks(
        self,
        hashes: Sequence[BlockHash],
        length: int,
        null: KVCacheBlock,
        token_ids: Sequence[int] = (),
        root: BlockHash = b"",
    ) -> list[list[KVCacheBlock]]:
        """Per group, the blocks of a hit of ``length`` (``hit_length``'s): ``null`` where a
        window group reads nothing."""
        out = []
        first0 = self.group0_blocks(hashes, length, token_ids, root)
        for g, w in enumerate(self.windows):
            if g == 0 and first0 is not None:
                out.append(first0[:length])
                continue
            first = first_live(w, length * self.block_size, self.block_size)
            blocks = [null] * first
            blocks += [self.table[self.key(g, hashes[i])] for i in range(first, length)]
            out.append(blocks)
        return out


class GroupedHashCache(GroupedHits, HashPrefixCache):
    """The hash cache keyed per group; only group 0's plain keys reach events."""

    def __init__(
        self,
        block_size: int,
        policy: EvictionPolicy,
        events: KVEventLog,
        windows: tuple[int | None, ...],
    ) -> None:
        HashPrefixCache.__init__(self, block_size, policy, events)
        self.windows = windows

    def _stored(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        first: int,
        last: int,
        cache_salt: str | None = None,
    ) -> None:
        if last > first and not tagged(hashes[first]):  # one insert = one group
            super()._stored(token_ids, hashes, first, last, cache_salt)

    def _removed(self, hashes: list[BlockHash]) -> None:
        super()._removed([h for h in hashes if not tagged(h)])

    def cached_hashes(self) -> list[BlockHash]:
        return [h for h in self.table if not tagged(h)]
