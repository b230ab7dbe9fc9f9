"""The hottest cached prefixes as a tree, for the web view (``GET /v1/kv/prefixes``).

Neither prefix cache keeps per-prefix hit counts, and the hash chain keeps no tokens,
so the tree is built from what the server saw: the prompts of the last finished
requests (``kv_state.RecentRequests``, their first ``PROMPT_HEAD_TOKENS`` ids). Each
prompt is hashed into its block chain (``kv/hashing.py``, the same hashes both prefix
caches use); the chain's blocks that the device cache still holds become a path in a
trie of blocks, and runs of blocks with one child and the same counts are merged into
one node, as a radix tree stores them.

Per node: ``requests`` (recent prompts that contain the prefix), ``hits`` (of those, the
ones whose device prefix hit covered it), its token range, size in bytes of KV, whether
exactly this prefix is pinned (``/v1/cache/unpin`` then releases it), and its own token
ids so the page can pin the prefix up to it (the ids of a node's ancestors, then its own).

Invariants: only unsalted prompts are listed (a ``cache_salt`` marks a tenant's
prefix); a node's parent precedes it in ``nodes``; every listed node's blocks were
cached when the tree was built; at most ``limit`` nodes plus the ancestors they need.
Built on the engine thread (``AsyncEngine.prefix_tree``); O(recent prompts' blocks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvstack.engine.llm_engine import LLMEngine
from kvstack.kv.hashing import hash_blocks, root_hash
from kvstack.kv.manager import KVCacheManager
from kvstack.serve.ui.kv_state import RecentRequests

MAX_SCAN = 128  # recent requests a tree is built from


@dataclass
class PrefixNode:
    id: int
    parent: int  # -1: a root
    start: int  # first token of this node (the prefix is tokens [0, end))
    end: int
    ids: list[int]  # token ids [start, end)
    requests: int
    hits: int
    bytes: int  # KV bytes of the whole prefix [0, end)
    pinned: bool
    text: str = ""  # the first tokens of this node, decoded (set off the engine thread)


@dataclass
class PrefixTree:
    prefix_cache: str
    block_size: int
    num_requests: int  # recent prompts the tree was built from
    nodes: list[PrefixNode] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Block:
    index: int  # block number in its chain
    parent: bytes | None
    ids: list[int]
    requests: int = 0
    hits: int = 0
    children: list[bytes] = field(default_factory=list)


def _trie(kv: KVCacheManager, recent: RecentRequests) -> tuple[dict[bytes, _Block], int]:
    bs = kv.block_size
    root = root_hash(kv.model_id, None)
    cached = set(kv.cached_hashes())
    blocks: dict[bytes, _Block] = {}
    seen = 0
    for r in list(recent.items)[-MAX_SCAN:]:
        if r.salted:
            continue
        seen += 1
        parent: bytes | None = None
        for i, h in enumerate(hash_blocks(r.prompt_head, bs, root)):
            if h not in cached:
                break
            b = blocks.get(h)
            if b is None:
                b = blocks[h] = _Block(i, parent, list(r.prompt_head[i * bs : (i + 1) * bs]))
                if parent is not None:
                    blocks[parent].children.append(h)
            b.requests += 1
            b.hits += r.device_hit_tokens >= (i + 1) * bs
            parent = h
    return blocks, seen


def build_prefix_tree(engine: LLMEngine, recent: RecentRequests, limit: int) -> PrefixTree:
    """The tree described in the module docstring (engine thread only)."""
    kv = engine.kv_manager
    if not isinstance(kv, KVCacheManager) or kv.cache is None:
        return PrefixTree("none", kv.block_size, 0)
    bs = kv.block_size
    blocks, seen = _trie(kv, recent)
    tree = PrefixTree(engine.config.cache.prefix_cache, bs, seen)
    # Merge runs: a block continues its parent's node when it is the only child and has
    # the same counts; a node ends at a branch, a count change or a pinned prefix end.
    nodes: list[PrefixNode] = []
    last_hash: list[bytes] = []
    node_of: dict[bytes, int] = {}
    bpt = engine.kv_bytes_per_token
    for h, b in blocks.items():  # insertion order: a parent before its children
        p = b.parent
        if p is not None and p not in kv.pins:
            pb = blocks[p]
            if len(pb.children) == 1 and (pb.requests, pb.hits) == (b.requests, b.hits):
                n = nodes[node_of[p]]
                n.end += bs
                n.ids.extend(b.ids)
                n.bytes = int(n.end * bpt)
                n.pinned = h in kv.pins
                node_of[h] = n.id
                last_hash[n.id] = h
                continue
        nid = len(nodes)
        start = b.index * bs
        parent = node_of[p] if p is not None else -1
        nodes.append(
            PrefixNode(
                nid,
                parent,
                start,
                start + bs,
                list(b.ids),
                b.requests,
                b.hits,
                int((start + bs) * bpt),
                h in kv.pins,
            )
        )
        node_of[h] = nid
        last_hash.append(h)
    tree.nodes = _hottest(nodes, limit)
    return tree


def _hottest(nodes: list[PrefixNode], limit: int) -> list[PrefixNode]:
    """The ``limit`` nodes with the most hits (then requests, then longer), with the
    ancestors they need, renumbered so a parent precedes its children."""
    keep: set[int] = set()
    for n in sorted(nodes, key=lambda n: (-n.hits, -n.requests, -n.end)):
        if len(keep) >= limit:
            break
        i = n.id
        while i >= 0 and i not in keep:
            keep.add(i)
            i = nodes[i].parent
    new_id = {old: k for k, old in enumerate(sorted(keep))}
    out = []
    for old in sorted(keep):
        n = nodes[old]
        n.id, n.parent = new_id[old], new_id.get(n.parent, -1)
        out.append(n)
    return out
