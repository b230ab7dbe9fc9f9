"""HybridKVManager: one block table per KV group, window groups free what no window sees.

vLLM v1's hybrid KV cache manager (``KVCacheCoordinator`` with a ``FullAttentionManager``
and a ``SlidingWindowManager`` per group over one ``BlockPool``), for models whose
layers attend differently (``kv/groups.py``: Gemma 3's local/global layers, Qwen2's
``max_window_layers``, Mistral). Every group has its own block table over one shared
pool of pages; a page holds ``block_size`` tokens of the group's ``layers_per_page``
layers, so the engine's memory serves any mix of groups.

A window group's row at position ``p`` reads keys ``(p - W, p]``. Before a step computes
rows from position ``c`` on, a block whose last slot is older than ``c - W + 1`` is read
by no future row: it is freed and its table entry becomes the *null page* (page 0,
never allocated, never written: vLLM's ``null_block``); long prompts never allocate such
blocks at all beyond what their chunk reads::

    W = 8, block_size 4, rows from c = 13 on (they read keys >= 6):
    full group:    [b0][b1][b2][b3][b4]
    window group:  [ 0][w1][w2][w3][w4]      block 0 (keys 0-3) freed: first live = 6 // 4

Prefix caching per group (``kv/hybrid_cache.py``, vLLM's ``find_longest_cache_hit``): a
hit needs every block of a full group but only the window's blocks of a window group; one
cache and one eviction policy hold every group's blocks, group 0's under the plain hashes
(KV events name them, for a window-only model too) or in the radix tree
(``kv/hybrid_radix.py``; a window-only model's tree holds tokens and tombstones,
``kv/hybrid_window_radix.py``), the others' under hashes tagged with the group.

Pins hold every page a hit of the whole pinned prefix needs (``kv/hybrid_pins.py``).
Offload tiers store and load *logical* blocks (every group's page of one block index;
``kv/tiers/connector.py``).
Presses (token eviction) compact a request into one fresh table per group (``replace_blocks``;
``kv/press/compact.py`` presses the full groups and keeps each window group's window).
Every KV codec works (kivi2 keeps its write plans and residual slots per group:
``kv/codecs/kivi.py``).
Implements ``kv/base.py``'s ``KVManager`` protocol; ``num_blocks`` counts pages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvstack.core.errors import ConfigError
from kvstack.core.request import Request
from kvstack.kv.base import cdiv
from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.kv.events import KVEventLog
from kvstack.kv.groups import KVGroups
from kvstack.kv.hashing import BlockHash
from kvstack.kv.hybrid_cache import GroupedHashCache, first_live
from kvstack.kv.hybrid_pins import HybridPins
from kvstack.kv.hybrid_radix import GroupedRadixCache
from kvstack.kv.hybrid_window_radix import WindowRadixCache
from kvstack.kv.paged_common import PagedCommon
from kvstack.kv.policies import make_policy
from kvstack.kv.residency import BlockResidency

UNSUPPORTED = "with the hybrid KV manager (a sliding-window model); pass "
UNSUPPORTED += "--disable-hybrid-kv-cache-manager to keep one block table for all layers"


class HybridKVManager(HybridPins, PagedCommon):
    """Paged KV bookkeeping with one block table per KV group (see the module docstring)."""

    block_unit = "KV pages (blocks of one group of layers)"

    def __init__(
        self,
        groups: KVGroups,
        num_pages: int,
        block_size: int,
        max_chunk_tokens: int,
        prefix_cache: str = "hash",
        eviction_policy: str = "lru",
        model_id: str = "",
        events: KVEventLog | None = None,
        residency: BlockResidency | None = None,
        max_pinned_fraction: float = 0.5,
    ) -> None:
        if prefix_cache not in ("hash", "radix", "none"):
            raise ConfigError(f"--prefix-cache {prefix_cache} is not supported " + UNSUPPORTED)
        if num_pages < 2:
            raise ConfigError(f"the hybrid KV manager needs at least 2 pages, got {num_pages}")
        self.kv_groups = groups
        self.windows = groups.windows
        self.block_size = block_size
        self.max_chunk_tokens = max_chunk_tokens
        self.events = events if events is not None else KVEventLog()
        self.cache: GroupedHashCache | GroupedRadixCache | None = None
        if prefix_cache != "none":
            kind: type[GroupedHashCache | GroupedRadixCache] = GroupedHashCache
            if prefix_cache == "radix":
                kind = GroupedRadixCache if self.windows[0] is None else WindowRadixCache
            policy = make_policy(eviction_policy, num_pages)
            self.cache = kind(block_size, policy, self.events, self.windows)
        self.pool = BlockPool(num_pages, self.cache, residency)
        self.null = self.pool.allocate(1)[0]  # page 0: the table entry of a freed block
        assert self.null.block_id == 0
        self.null.is_null = True
        self.model_id = model_id
        self.tables: dict[str, list[list[KVCacheBlock]]] = {}
        self._num_inserted: dict[str, int] = {}
        # request id -> (first, end) logical blocks an offload connector filled at
        # admission (registered in the cache, never reported as newly computed)
        self._external: dict[str, tuple[int, int]] = {}
        self.max_pinned_fraction = max_pinned_fraction
        self.pins: dict[BlockHash, list[KVCacheBlock]] = {}  # last block hash -> every page
        self.soft_pins: dict[BlockHash, None] = {}  # none made here: no pin_cached_prefix
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ------------------------------------------------------------------ sizes
    @property
    def num_blocks(self) -> int:
        """Pages a request can hold (the null page excluded)."""
        return self.pool.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def held_request_ids(self) -> list[str]:
        return list(self.tables)

    def first_live(self, group: int, position: int) -> int:
        """First block a row at ``position`` (or later) of ``group`` still reads."""
        return first_live(self.windows[group], position, self.block_size)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Pages a sequence of ``num_tokens`` holds at its peak, over all groups (a window
        group: its window plus one step's chunk)."""
        full = cdiv(num_tokens, self.block_size)
        peak = [
            full
            if w is None
            else min(full, cdiv(w - 1 + self.max_chunk_tokens, self.block_size) + 1)
            for w in self.windows
        ]
        return sum(peak)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= self.num_blocks

    # ------------------------------------------------------------------ prefix hits
    def _hit_tables(self, request: Request, limit: int) -> list[list[KVCacheBlock]]:
        """Per group, the blocks of the longest hit of at most ``limit`` blocks every
        group serves (``kv/hybrid_cache.py``; null pages where a window group reads nothing)."""
        if self.cache is None or limit <= 0:
            return [[] for _ in self.windows]
        hashes, ids, root = self.block_hashes(request), request.all_token_ids, self.root_of(request)
        length = self.cache.hit_length(hashes, limit, ids, root)
        return self.cache.hit_blocks(hashes, length, self.null, ids, root)

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Group 0's blocks of the longest prefix every group serves (changes nothing);
        ``allocate_slots`` finds the other groups' blocks of the same hit again."""
        if self.cache is None or request.sampling_params.prompt_logprobs is not None:
            return []
        return self._hit_tables(request, (request.num_tokens - 1) // self.block_size)[0]

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        num_external_blocks: int = 0,
    ) -> list[int] | None:
        """Grow every group's table to cover ``num_kv_tokens + (len(computed) + ext) * bs
        + num_new_tokens`` slots, freeing window groups' blocks no row from the step's
        first position on reads; None (nothing changed) when the pool is too small.

        ``computed`` (admission only): group 0's blocks of a prefix hit; the other groups'
        blocks of the same hit are found again. ``num_external_blocks`` logical blocks
        follow it for an offload connector to fill (``logical_pages``): fresh pages in
        every full group, and in a window group only where a row of the step reads them.
        """
        rid = request.request_id
        tables = self.tables.get(rid)
        ext = num_external_blocks
        assert not ((computed or ext) and tables), "hits are adopted only at admission"
        hit = len(computed) + ext
        start = request.num_kv_tokens + hit * self.block_size  # first row of this step
        target = cdiv(start + num_new_tokens, self.block_size)
        hits = self._adoptable(request, len(computed), start) if hit else None
        current = tables if tables is not None else hits or [[] for _ in self.windows]
        fresh_pages, extra = self._pages_needed(current, start, target, hits is not None)
        if fresh_pages + extra > self.num_free_blocks:
            return None
        if self.cache is not None and request.num_computed_tokens == 0 and tables is None:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += hit * self.block_size
        if hits is not None and computed:
            assert self.cache is not None
            real = [b for t in hits for b in t if b is not self.null]
            self.pool.touch(real)
            self.cache.on_hit(real)
        tables = self.tables.setdefault(rid, current)
        for g, blocks in enumerate(tables):
            self._drop_dead(blocks, self.first_live(g, start))
        fresh = iter(self.pool.allocate(fresh_pages))  # _drop_dead kept the tables' lengths
        for g, blocks in enumerate(tables):
            first = self.first_live(g, start)
            blocks.extend(
                next(fresh) if i >= first else self.null for i in range(len(blocks), target)
            )
        if ext:
            self._external[rid] = (len(computed), hit)
        self._cache_full_blocks(request, min(start + num_new_tokens, request.num_tokens))
        if ext and self.cache is not None:
            loaded = [b for t in tables for b in t[len(computed) : hit] if b is not self.null]
            self.cache.on_hit([b for b in loaded if b.block_hash is not None])
        return [b.block_id for b in tables[0]]

    def _adoptable(self, request: Request, num_hit: int, start: int) -> list[list[KVCacheBlock]]:
        """Per group, the hit's blocks that rows from ``start`` on still read (null pages
        before each window group's first live block; all null pages without a hit)."""
        hits = self._hit_tables(request, num_hit) if num_hit else [[] for _ in self.windows]
        assert len(hits[0]) == num_hit, "the hit changed since get_computed_blocks"
        for g, blocks in enumerate(hits):
            for i in range(min(self.first_live(g, start), len(blocks))):
                blocks[i] = self.null
        return hits

    def _pages_needed(
        self, tables: list[list[KVCacheBlock]], start: int, target: int, adopting: bool
    ) -> tuple[int, int]:
        """What the free count loses when ``tables`` grow to ``target`` blocks for rows
        from ``start`` on: ``(fresh pages, extra)``, extra being the adopted evictable hit
        pages (``adopting``) or minus this request's pages that fall out of a window (they
        become free)."""
        fresh = extra = 0
        for g, blocks in enumerate(tables):
            first = self.first_live(g, start)
            fresh += sum(1 for i in range(len(blocks), target) if i >= first)
            if adopting:
                extra += sum(1 for b in blocks if b is not self.null and b.ref_cnt == 0)
            else:
                extra -= sum(1 for b in blocks[:first] if b is not self.null and b.ref_cnt == 1)
        return fresh, extra

    def admission_cost(
        self,
        request: Request,
        computed: Sequence[KVCacheBlock],
        num_external_blocks: int,
        num_new_tokens: int,
    ) -> int:
        start = request.num_kv_tokens + (len(computed) + num_external_blocks) * self.block_size
        hits = self._adoptable(request, len(computed), start)
        return sum(
            self._pages_needed(hits, start, cdiv(start + num_new_tokens, self.block_size), True)
        )

    def logical_pages(self, request_id: str, first: int, end: int) -> list[list[int | None]]:
        tables = self.tables[request_id]
        return [
            [None if t[i] is self.null else t[i].block_id for t in tables]
            for i in range(first, end)
        ]

    def page_keys(self, block_hash: BlockHash) -> list[BlockHash]:
        assert self.cache is not None
        return [self.cache.key(g, block_hash) for g in range(len(self.windows))]

    def _drop_dead(self, blocks: list[KVCacheBlock], first: int) -> None:
        """Free the blocks before ``first`` (newest first), leaving null pages."""
        dead = [i for i in range(min(first, len(blocks))) if blocks[i] is not self.null]
        self.pool.free(blocks[i] for i in reversed(dead))
        for i in dead:
            blocks[i] = self.null

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every group's live blocks completely covered by ``num_tokens`` tokens
        (and, for a connector, the logical blocks that became reusable with every page)."""
        if self.cache is None or request.press_applied:
            return  # a pressed request's pages no longer hold a token prefix
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self._num_inserted.get(rid, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)[:num_full]
        root = self.root_of(request)
        tables = self.tables[rid]
        new = self._new_cached  # an offload connector's: which blocks are new, before insert
        fresh = []
        if new is not None:
            fresh = [i for i in range(start, num_full) if tables[0][i].block_hash is None]
        for g, blocks in enumerate(tables):
            if g == 0:  # plain hashes and events (a null page is skipped)
                self.cache.insert(request.all_token_ids, hashes, blocks, root, request.cache_salt)
                continue
            idx = [i for i in range(start, num_full) if blocks[i] is not self.null]
            keys = [self.cache.key(g, hashes[i]) for i in idx]
            self.cache.insert((), keys, [blocks[i] for i in idx], root)
        self._num_inserted[rid] = num_full
        if new is not None:
            first, end = self._external.get(rid, (0, 0))
            for i in fresh:  # a block loaded from a tier has nothing new to store
                pages = [t[i] for t in tables]
                if not first <= i < end and all(b is not self.null for b in pages):
                    new.append((hashes[i], pages))

    def get_block_ids(self, request_id: str) -> list[int]:
        tables = self.tables.get(request_id)
        return [b.block_id for b in tables[0]] if tables else []

    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Every group's block table (page 0 where a window group freed a block)."""
        tables = self.tables.get(request_id)
        return [[b.block_id for b in t] for t in tables] if tables else None

    def num_held_pages(self, request_id: str) -> int:
        """Pages ``request_id`` holds now over all groups (what the hybrid layout saves)."""
        tables = self.tables.get(request_id, [])
        return sum(1 for t in tables for b in t if b is not self.null)

    def free(self, request: Request | str) -> None:
        rid = request if isinstance(request, str) else request.request_id
        tables = self.tables.pop(rid, None)
        self._num_inserted.pop(rid, None)
        self._external.pop(rid, None)
        for blocks in tables or ():
            self.pool.free(b for b in reversed(blocks) if b is not self.null)

    def rollback_slots(self, request: Request) -> int:
        """Free every group's blocks past the slot of the last real token (draft rows
        only: never hashed, never shared); see ``KVCacheManager.rollback_slots``."""
        tables = self.tables.get(request.request_id)
        if not tables:
            return 0
        keep = cdiv(request.num_tokens - request.num_dropped, self.block_size)
        freed = 0
        for blocks in tables:
            tail = blocks[keep:]
            for b in tail:
                assert b.block_hash is None and b.ref_cnt == 1, f"block {b.block_id} is shared"
            del blocks[keep:]
            self.pool.free(reversed(tail))
            freed += len(tail)
        return freed

    def waste_slots(self, running: Iterable[Request]) -> int:
        """Reserved page slots not yet written: each group's tail-block slack."""
        n = len(self.windows) * self.block_size
        return sum(
            len(self.tables[r.request_id][0]) * n - r.num_kv_tokens * len(self.windows)
            for r in running
            if r.request_id in self.tables
        )

    # ------------------------------------------------------------------ not with groups
    def set_block_free_hook(self, hook: Callable[[int], None] | None) -> None:
        """A codec hears of pages whose contents die (kivi2 frees a filling page's residual)."""
        self.pool.on_plain_free = hook

    # ------------------------------------------------------------------ presses
    def replace_blocks(self, request: Request, tables: Sequence[Sequence[int]]) -> int:
        """A press compacted the request's KV into one fresh table per group (pages from
        ``allocate_blocks``; 0 = the null page where a window group reads nothing): free
        the old pages (tail first) and return how many went back to the pool. As with
        one table, the old pages keep their prefix-cache entries (``kv/manager.py``); a
        pressed request's pages are never cached (``_cache_full_blocks``)."""
        rid = request.request_id
        old = self.tables[rid]
        assert len(tables) == len(old) and len({len(t) for t in tables}) == 1
        blocks = self.pool.blocks
        self.tables[rid] = [[self.null if i == 0 else blocks[i] for i in t] for t in tables]
        for t in old:
            self.pool.free(b for b in reversed(t) if b is not self.null)
        self._external.pop(rid, None)  # tier-loaded indices name the old tables
        held = sum(1 for t in old for b in t if b is not self.null)
        return held - sum(1 for t in tables for i in t if i != 0)

    def reset_prefix_cache(self) -> None:
        if self.cache is None:
            return
        self.release_pins()
        self.pool.reclaim(self.cache.reset())
        self._num_inserted.clear()
        self._external.clear()
        if self.pool.residency is not None:
            self.pool.residency.reset()

    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the entries of the pages a failed step wrote (any group's; the null page
        is never cached); pins and every other entry stay (``step_isolation.py``)."""
        if self.cache is not None:
            pages = [self.pool.blocks[i] for i in block_ids]
            self.pool.reclaim(self.cache.forget([b for b in pages if b is not self.null]))

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        """Pool invariants; every reference is a table entry (or the null page's own);
        tables of one request have one length; a window group holds no block its
        request's next row cannot read, a full group no null page."""
        self.pool.check_integrity()
        held: dict[int, int] = {0: 1}
        for rid, tables in self.tables.items():
            assert len({len(t) for t in tables}) == 1, f"{rid}: tables of different lengths"
            for g, blocks in enumerate(tables):
                real = [b.block_id for b in blocks if b is not self.null]
                assert len(set(real)) == len(real), f"{rid} holds a block twice in group {g}"
                if self.windows[g] is None:
                    assert len(real) == len(blocks), f"{rid}: a null page in full group {g}"
                for i in real:
                    held[i] = held.get(i, 0) + 1
        for chain in self.pins.values():
            for b in chain:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), (
                f"page {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{held.get(block.block_id, 0)} table and pin references"
            )
        assert self.null.block_hash is None, "the null page is never cached"
        for rid, (first, end) in self._external.items():
            assert rid in self.tables and 0 <= first <= end <= len(self.tables[rid][0]), rid
