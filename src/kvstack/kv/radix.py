"""Prefix reuse, second form: a token radix tree over KV blocks (SGLang's RadixAttention).

Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs"
(2024), keep every cached prefix in a radix tree keyed by token ids, lock the nodes a
running request uses, and evict unlocked leaves. Here the tree is paged: an edge is a
run of whole blocks (``block_size`` tokens each), so a node holds ``chunks`` (the
tokens of each block) and the matching ``blocks``::

    root
     └─ [sys0 sys1 sys2] ─┬─ [q0a q1a]          request A: sys + qa
                          └─ [q0b] ─ [q1b q2b]  request B: sys + qb (+ its later blocks)

Matching compares tokens chunk by chunk (no hash can collide); a match that ends
inside a node splits it there, so every node's blocks are held by the same holders.
The "lock ref" of a node is its blocks' ``ref_cnt``: a running request or a pin holds
every block on its path, so references never increase going down a path, and an
unreferenced block has no referenced descendant.

Eviction peels leaves: a block is an eviction *candidate* when it is unreferenced and
the last block of a leaf; evicting it exposes the block before it (or the parent's
last block once the leaf is empty) as the next candidate. Which candidate goes first
is the eviction policy's choice (keys are the blocks' chained hashes, computed anyway
for KV events). All unreferenced blocks are evictable by repeated peeling, so
``num_evictable`` counts them all.

Unlike the hash cache, a request never adds blocks below a prefix block it does not
hold: if another request cached the same block concurrently, insertion stops there
(its remaining blocks stay uncached), which keeps the reference-monotone invariant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.events import KVEventLog
from kvstack.kv.hashing import BlockHash
from kvstack.kv.policies import EvictionPolicy
from kvstack.kv.prefix_cache import PrefixCache

Chunk = tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    parent: RadixNode | None
    chunks: list[Chunk] = field(default_factory=list)
    blocks: list[KVCacheBlock] = field(default_factory=list)
    children: dict[Chunk, RadixNode] = field(default_factory=dict)

    @property
    def is_leaf(self) -> bool:
        return not self.children


class RadixPrefixCache(PrefixCache):
    name = "radix"

    def __init__(self, block_size: int, policy: EvictionPolicy, events: KVEventLog) -> None:
        super().__init__(block_size, policy, events)
        self.roots: dict[BlockHash, RadixNode] = {}
        self.node_of: dict[int, RadixNode] = {}  # block_id -> node holding it
        self.by_hash: dict[BlockHash, KVCacheBlock] = {}
        self._num_unreferenced = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self.by_hash)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self.by_hash)

    @property
    def num_evictable(self) -> int:
        return self._num_unreferenced

    def _chunk(self, token_ids: Sequence[int], i: int) -> Chunk:
        bs = self.block_size
        return tuple(token_ids[i * bs : (i + 1) * bs])

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after its first ``k`` blocks; returns the new upper node."""
        assert 0 < k < len(node.blocks) and node.parent is not None
        top = RadixNode(node.parent, node.chunks[:k], node.blocks[:k])
        node.parent.children[node.chunks[0]] = top
        node.chunks, node.blocks = node.chunks[k:], node.blocks[k:]
        node.parent = top
        top.children[node.chunks[0]] = node
        for block in top.blocks:
            self.node_of[block.block_id] = top
        return top

    def match(
        self, token_ids: Sequence[int], hashes: Sequence[BlockHash], root: BlockHash
    ) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        node = self.roots.get(root)
        n = len(hashes)
        i = 0
        while node is not None and i < n:
            child = node.children.get(self._chunk(token_ids, i))
            if child is None:
                break
            k = 1
            while k < len(child.chunks) and i + k < n:
                if child.chunks[k] != self._chunk(token_ids, i + k):
                    break
                k += 1
            if k < len(child.chunks):
                child = self._split(child, k)
            out.extend(child.blocks)
            i += k
            node = child
        return out

    def insert(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        root: BlockHash,
        cache_salt: str | None = None,
    ) -> None:
        node = self.roots.setdefault(root, RadixNode(None))
        n = len(hashes)
        i = 0
        while i < n:
            child = node.children.get(self._chunk(token_ids, i))
            if child is None:
                self._add_leaf(node, token_ids, hashes, blocks, i, n, cache_salt)
                return
            k = 0
            while k < len(child.chunks) and i + k < n:
                if child.chunks[k] != self._chunk(token_ids, i + k):
                    break
                if child.blocks[k] is not blocks[i + k]:
                    return  # someone else's copy of this block: stop (see module doc)
                k += 1
            if k < len(child.chunks) and i + k < n:
                child = self._split(child, k)
            i += k
            node = child

    def _add_leaf(
        self,
        parent: RadixNode,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        cache_salt: str | None = None,
    ) -> None:
        if parent.parent is not None and parent.is_leaf:
            tail = parent.blocks[-1].block_hash
            assert tail is not None and tail not in self.policy, "parent must be held"
        leaf = RadixNode(parent)
        for i in range(start, end):
            block = blocks[i]
            assert block.block_hash is None and block.ref_cnt > 0
            block.block_hash = hashes[i]
            leaf.chunks.append(self._chunk(token_ids, i))
            leaf.blocks.append(block)
            self.node_of[block.block_id] = leaf
            self.by_hash[hashes[i]] = block
            self.policy.on_insert(hashes[i])
        parent.children[leaf.chunks[0]] = leaf
        self._stored(token_ids, hashes, start, end, cache_salt)

    def _is_leaf_tail(self, block: KVCacheBlock) -> bool:
        node = self.node_of[block.block_id]
        return node.is_leaf and node.blocks[-1] is block

    def on_release(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        self._num_unreferenced += 1
        if self._is_leaf_tail(block):
            self.policy.on_release(block.block_hash)

    def on_acquire(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        self._num_unreferenced -= 1
        if block.block_hash in self.policy:
            self.policy.on_acquire(block.block_hash)

    def _detach(self, block_hash: BlockHash) -> KVCacheBlock:
        """Peel the victim (a leaf's last block) and expose the next candidate, if any."""
        block = self.by_hash.pop(block_hash)
        node = self.node_of.pop(block.block_id)
        assert node.is_leaf and node.blocks[-1] is block
        key = node.chunks[0]
        node.blocks.pop()
        node.chunks.pop()
        self._num_unreferenced -= 1
        exposed: RadixNode | None = node
        if not node.blocks:
            parent = node.parent
            assert parent is not None
            del parent.children[key]
            exposed = parent if parent.parent is not None and parent.is_leaf else None
        if exposed is not None and exposed.blocks[-1].ref_cnt == 0:
            tail = exposed.blocks[-1].block_hash
            assert tail is not None
            self.policy.on_release(tail)
        return block

    def forget(self, blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        """Cut the tree above each block and drop the subtree below the cut (a
        descendant's KV was computed from the forgotten block's: it goes too)."""
        freed: list[KVCacheBlock] = []
        removed: list[BlockHash] = []
        for block in blocks:
            h = block.block_hash
            if h is None or self.by_hash.get(h) is not block:
                continue  # not cached, or gone with an earlier block's subtree
            node = self.node_of[block.block_id]
            k = node.blocks.index(block)
            if k > 0:
                self._split(node, k)  # ``node`` keeps the blocks from ``block`` on
            parent = node.parent
            assert parent is not None
            del parent.children[node.chunks[0]]
            self._drop_subtree(node, freed, removed)
            if parent.parent is not None and parent.is_leaf and parent.blocks[-1].ref_cnt == 0:
                tail = parent.blocks[-1].block_hash
                assert tail is not None
                self.policy.on_release(tail)  # the parent's tail is a candidate now
        self._removed(removed)
        return freed

    def _drop_subtree(
        self, top: RadixNode, freed: list[KVCacheBlock], removed: list[BlockHash]
    ) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for block in node.blocks:
                h = block.block_hash
                assert h is not None
                del self.by_hash[h]
                del self.node_of[block.block_id]
                self.policy.on_remove(h)  # held or candidate
                block.block_hash = None
                removed.append(h)
                if block.ref_cnt == 0:
                    self._num_unreferenced -= 1
                    freed.append(block)

    def _drop_all(self) -> list[KVCacheBlock]:
        freed = [b for b in self.by_hash.values() if b.ref_cnt == 0]
        for block in self.by_hash.values():
            block.block_hash = None
        self.roots.clear()
        self.node_of.clear()
        self.by_hash.clear()
        self._num_unreferenced = 0
        return freed

    def check_integrity(self) -> None:
        seen = 0
        unreferenced = 0
        candidates = 0
        stack: list[tuple[RadixNode, int | None]] = [(r, None) for r in self.roots.values()]
        while stack:
            node, above = stack.pop()
            if node.parent is not None:
                assert node.blocks, "empty non-root node"
                assert len(node.chunks) == len(node.blocks)
            refs_above: int | None = above
            for chunk, block in zip(node.chunks, node.blocks, strict=True):
                assert len(chunk) == self.block_size
                assert block.block_hash is not None
                assert self.by_hash.get(block.block_hash) is block, "hash index out of sync"
                assert self.node_of.get(block.block_id) is node, "node index out of sync"
                assert refs_above is None or block.ref_cnt <= refs_above, (
                    f"block {block.block_id} referenced more than its ancestor"
                )
                refs_above = block.ref_cnt
                seen += 1
                unreferenced += block.ref_cnt == 0
                is_candidate = block.block_hash in self.policy
                should = block.ref_cnt == 0 and node.is_leaf and block is node.blocks[-1]
                assert is_candidate == should, (
                    f"block {block.block_id}: candidate={is_candidate}, expected {should}"
                )
                candidates += is_candidate
            for key, child in node.children.items():
                assert child.parent is node and child.chunks[0] == key
                stack.append((child, refs_above))
        assert seen == len(self.by_hash) == len(self.node_of)
        assert unreferenced == self._num_unreferenced
        assert candidates + self._other_candidates() == len(self.policy)
        self.policy.check_integrity()

    def _other_candidates(self) -> int:
        """Policy candidates outside the tree (the hybrid manager's window pages, checked
        there); none here."""
        return 0
