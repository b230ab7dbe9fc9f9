"""The radix prefix cache of a model whose every layer slides a window (Mistral).

``kv/hybrid_radix.py`` keeps group 0 — a full-attention group — in the token tree and
looks the window groups' pages up by key. A window-only model has no full group: every
page of a request falls out of its window while it decodes and is freed mid-path, which a
tree whose pages are held along whole paths (``kv/radix.py``) cannot express. SGLang's
``SWARadixCache`` answers with *tombstones*: a node whose window KV was evicted stays in
the tree for the nodes below it. Here the tree holds only tokens — one node per block,
its chunk of ``block_size`` token ids and its chained hash — and every group's page sits
in the hash table under ``group_key(g, hash)`` (``kv/hybrid_cache.py``), an eviction
candidate as soon as nothing holds it. A node none of whose groups' pages is cached is a
tombstone; tombstone *leaves* are pruned at once, so the tree never outgrows the pages::

    tree (tokens):   root ─ [c0] ─ [c1] ─ [c2] ─ [c3] ─┬─ [c4] ─ [c5]   request A
                                                       └─ [c4']        request B
    pages (W = 2 blocks): c2 c3 c4 c5 c4' cached; c0 c1 evicted (tombstones, kept:
    they have descendants)
    a hit of 6 blocks: tokens match c0..c5 in the tree, the window needs pages c4 c5

A hit is matched token by token first (its length is the longest path of equal chunks
under the request's root: no hash is trusted alone), then shortened by
``GroupedHits.hit_length`` to what every group's window serves. Events are the hash
cache's: group 0's pages stored (with their tokens) and removed; a window-only model's
events therefore name blocks whose removal leaves later blocks usable, as the hash cache
says. Deviation from SGLang: its tree holds the KV (full and window) per node and locks
nodes; this tree holds only tokens and leaves the pages to the hash table and its policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.events import KVEventLog
from kvstack.kv.hashing import BlockHash
from kvstack.kv.hybrid_cache import HASH_LEN, GroupedHashCache, tagged
from kvstack.kv.policies import EvictionPolicy

Chunk = tuple[int, ...]


@dataclass(eq=False)
class TokenNode:
    """One block of a cached token path: its chunk of tokens and chained hash (a root:
    no chunk, the chain's root hash)."""

    parent: TokenNode | None
    chunk: Chunk = ()
    block_hash: BlockHash = b""
    children: dict[Chunk, TokenNode] = field(default_factory=dict)


class WindowRadixCache(GroupedHashCache):
    """Token tree + per-group page table (see the module docstring).

    Invariants (``check_integrity``): the hash cache's for the pages; every tree node but
    a root has a chunk of ``block_size`` tokens and is indexed by its hash; every group-0
    key in the table has a node; no leaf is a tombstone (each leaf has a cached page in
    some group), and no root is bare (one per cache salt would pile up).
    """

    name = "radix"

    def __init__(
        self,
        block_size: int,
        policy: EvictionPolicy,
        events: KVEventLog,
        windows: tuple[int | None, ...],
    ) -> None:
        super().__init__(block_size, policy, events, windows)
        self.roots: dict[BlockHash, TokenNode] = {}
        self.nodes: dict[BlockHash, TokenNode] = {}  # group-0 hash -> node

    def _chunk(self, token_ids: Sequence[int], i: int) -> Chunk:
        bs = self.block_size
        return tuple(token_ids[i * bs : (i + 1) * bs])

    def matched_blocks(self, token_ids: Sequence[int], limit: int, root: BlockHash) -> int:
        """Blocks (``<= limit``) of ``token_ids`` on a path of the tree, chunk by chunk."""
        node = self.roots.get(root)
        n = 0
        while node is not None and n < limit:
            node = node.children.get(self._chunk(token_ids, n))
            n += node is not None
        return n

    def hit_length(
        self,
        hashes: Sequence[BlockHash],
        limit: int,
        token_ids: Sequence[int] = (),
        root: BlockHash = b"",
    ) -> int:
        limit = self.matched_blocks(token_ids, min(limit, len(hashes)), root)
        return super().hit_length(hashes, limit, token_ids, root)

    def insert(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        root: BlockHash,
        cache_salt: str | None = None,
    ) -> None:
        """Pages into the table (the hash cache's insert and events); for group 0, the
        token path of ``hashes`` into the tree, tombstones included (a null page: a block
        no window read when it was computed). The hybrid manager inserts group 0 first and
        the other groups' pages of the same blocks right after, so the path's last block
        (computed in this step, inside every window) is never a tombstone leaf. The path
        is walked from its deepest block already in the tree (a chained hash names its
        whole prefix), not from the root: a request inserts every block it fills."""
        super().insert(token_ids, hashes, blocks, root, cache_salt)
        if not hashes or tagged(hashes[0]):
            return
        start = len(hashes)
        node = None
        while node is None and start > 0:
            start -= 1
            node = self.nodes.get(hashes[start])
        if node is None:
            node = self.roots.setdefault(root, TokenNode(None, (), root))
        else:
            start += 1
        for i in range(start, len(hashes)):
            chunk = self._chunk(token_ids, i)
            child = node.children.get(chunk)
            if child is None:
                child = TokenNode(node, chunk, hashes[i])
                node.children[chunk] = child
                self.nodes[hashes[i]] = child
            assert child.block_hash == hashes[i], "one chunk under one parent, two hashes"
            node = child

    def _live(self, node: TokenNode) -> bool:
        return any(self.key(g, node.block_hash) in self.table for g in range(len(self.windows)))

    def _detach(self, block_hash: BlockHash) -> KVCacheBlock:
        block = super()._detach(block_hash)
        node = self.nodes.get(block_hash[:HASH_LEN])
        while node is not None and node.parent is not None:
            if node.children or self._live(node):
                return block
            parent = node.parent
            del parent.children[node.chunk]
            del self.nodes[node.block_hash]
            node = parent
        if node is not None and not node.children:  # a root (its hash: the chain's root)
            del self.roots[node.block_hash]
        return block

    def _drop_all(self) -> list[KVCacheBlock]:
        self.roots.clear()
        self.nodes.clear()
        return super()._drop_all()

    def check_integrity(self) -> None:
        super().check_integrity()
        seen = 0
        for root, top in self.roots.items():
            assert top.parent is None and top.block_hash == root and top.children, "a bare root"
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for chunk, child in node.children.items():
                assert child.parent is node and child.chunk == chunk
                assert len(chunk) == self.block_size, "a partial chunk in the tree"
                assert self.nodes.get(child.block_hash) is child, "node index out of sync"
                assert child.children or self._live(child), "a tombstone leaf"
                seen += 1
                stack.append(child)
        assert seen == len(self.nodes), "unreachable nodes indexed"
        for h in self.table:
            assert tagged(h) or h in self.nodes, "a group-0 page without a tree node"
