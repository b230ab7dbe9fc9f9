"""KVCacheManager: which blocks each request holds (vLLM v1 ``kv_cache_manager.py``).

The scheduler asks ``get_computed_blocks(request)`` (the longest cached prefix) when it
admits a request, then ``allocate_slots(request, num_new_tokens, computed)``: the table
grows to ``num_computed_tokens + num_new_tokens`` slots, or None (nothing changed) when
the pool is too small, so the scheduler can preempt someone and retry.

Block table of a request with block_size 4 after a 4-token prefix hit and 6 computed
tokens::

    slots:   [0 1 2 3][4 5 6 7][8 9 . .]
    blocks:   b17      b3       b42        <- block_ids, logical order
              ^ shared (prefix hit)   ^ 2 slots still free in the last block

Blocks are registered in the prefix cache *when they are scheduled*, not after the
step: the runner writes every new K/V of a step before any attention reads, so a
request admitted later in the same step can already reuse them (vLLM v1 does the
same). That is what stops 32 simultaneous prompts with one system prompt from all
computing it. A step that fails must therefore drop what it registered
(``forget_blocks``; ``engine/step_isolation.py`` says which); the rest stays. The last
prompt token is always computed (a hit covers at most ``num_tokens - 1`` tokens,
block-aligned). Sliding-window models get ``kv/hybrid.py``.

Externally loaded blocks (offload tiers, vLLM v1's connector shape): the connector says how
many blocks after the device hit it can supply; ``allocate_slots(..., num_external_blocks=k)``
allocates them with the rest, registers them in the prefix cache like computed blocks,
and the connector writes their KV through ``KVStorage`` before the step runs::

    tokens:  [ device hit ][ k external ][ new tokens (this step) ][ . free . ]
    blocks:   computed       fresh, filled by the connector         fresh

Implements ``kv/base.py``'s ``KVManager`` protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvstack.core.errors import InvalidRequestError
from kvstack.core.registry import Registry
from kvstack.core.request import Request
from kvstack.kv.base import KVCacheStats, cdiv
from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.kv.events import KVEventLog
from kvstack.kv.hashing import BlockHash, root_hash
from kvstack.kv.paged_common import PagedCommon
from kvstack.kv.policies import EvictionPolicy, make_policy
from kvstack.kv.prefix_cache import HashPrefixCache, PrefixCache
from kvstack.kv.radix import RadixPrefixCache
from kvstack.kv.residency import BlockResidency
from kvstack.kv.segments import SegmentCache

__all__ = ["PREFIX_CACHES", "KVCacheManager", "KVCacheStats", "cdiv"]

# Prefix reuse (``--prefix-cache``); None = recompute every prompt.
PREFIX_CACHES: Registry[type[PrefixCache] | None] = Registry("prefix cache")
PREFIX_CACHES.add("hash", HashPrefixCache, "vLLM's block hash chain (default)")
PREFIX_CACHES.add("radix", RadixPrefixCache, "SGLang's token radix tree")
PREFIX_CACHES.add("none", None, "recompute every prompt")


class KVCacheManager(PagedCommon):
    """Paged KV bookkeeping with an optional prefix cache (``hash``, ``radix``, ``none``)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: str = "hash",
        eviction_policy: str = "lru",
        max_pinned_fraction: float = 0.5,
        model_id: str = "",
        events: KVEventLog | None = None,
        policy: EvictionPolicy | None = None,
        residency: BlockResidency | None = None,
    ) -> None:
        """``policy``: an already built eviction policy used instead of the one named
        ``eviction_policy`` (``kvstack analyze`` passes its Belady oracle); ``residency``
        samples block lifetimes (vLLM's ``--kv-cache-metrics``)."""
        cls = PREFIX_CACHES.get(prefix_cache)
        self.block_size = block_size
        self.events = events if events is not None else KVEventLog()
        if policy is None:
            policy = make_policy(eviction_policy, num_blocks)
        self.cache: PrefixCache | None = (
            cls(block_size, policy, self.events) if cls is not None else None
        )
        self.pool = BlockPool(num_blocks, self.cache, residency)
        self.model_id = model_id
        self.max_pinned_fraction = max_pinned_fraction
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_inserted: dict[str, int] = {}
        self.pins: dict[BlockHash, list[KVCacheBlock]] = {}  # last block hash -> chain
        self.soft_pins: dict[BlockHash, None] = {}  # ``pin_cached_prefix``'s, oldest first
        self.num_soft_pins_released = 0  # released early because the pool ran short
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self._new_cached = None  # offload tiers: ``PagedCommon.track_new_cached_blocks``
        # request id -> (first, end) block indices loaded by the connector at admission
        # (registered in the cache, never reported as newly computed).
        self._external: dict[str, tuple[int, int]] = {}
        self.segments: SegmentCache | None = None  # segment reuse: ``enable_segments``

    def enable_segments(
        self, sink: Sequence[int], max_fraction: float = 0.5, policy: str = "lru"
    ) -> SegmentCache:
        """Keep standalone segment KV (``kv/segments.py``) in this pool, evicted in the
        order of eviction policy ``policy``, announced on this manager's KV events."""
        self.segments = SegmentCache(
            self.pool, self.block_size, tuple(sink), max_fraction, policy, self.events
        )
        return self.segments

    @property
    def num_free_blocks(self) -> int:
        """Free, evictable cached, idle segment and softly pinned blocks (all are given back
        on demand)."""
        idle = self.segments.evictable_blocks() if self.segments is not None else 0
        return self.pool.num_free_blocks + idle + self._soft_only_blocks()

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.pool.num_blocks

    def held_request_ids(self) -> list[str]:
        return list(self.req_blocks)

    def set_block_free_hook(self, hook: Callable[[int], None] | None) -> None:
        """Call ``hook(block_id)`` when a block's contents die (KIVI frees its residual)."""
        self.pool.on_plain_free = hook

    def num_free_blocks_adopting(self, computed: Sequence[KVCacheBlock]) -> int:
        """Free blocks left once the prefix hit ``computed`` is adopted."""
        return self.pool.num_free_blocks - sum(1 for b in computed if b.ref_cnt == 0)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits in the pool next to the (hard) pins."""
        hard = {b.block_id for k, c in self.pins.items() if k not in self.soft_pins for b in c}
        return self.num_blocks_for(num_tokens) <= self.pool.num_blocks - len(hard)

    # ------------------------------------------------------------------ allocation
    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Blocks of the longest cached prefix of ``request`` (changes nothing).

        Requests that want prompt logprobs need every prompt position computed, so
        they skip the lookup (as in vLLM).
        """
        if self.cache is None or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request)[:max_blocks]
        return self.cache.match(request.all_token_ids, hashes, self.root_of(request))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        num_external_blocks: int = 0,
    ) -> list[int] | None:
        """Ensure slots for ``num_kv_tokens + (len(computed) + ext) * bs + num_new_tokens``.

        ``computed`` (admission only) are prefix-hit blocks from ``get_computed_blocks``;
        they are adopted. ``num_external_blocks`` (admission only) fresh blocks follow
        them, for a connector to fill; the caller advances ``num_computed_tokens`` past
        both. Returns the request's whole block-id table, or None when there are not
        enough free blocks (nothing changes in that case).
        """
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        ext = num_external_blocks
        assert not ((computed or ext) and blocks), "hits are adopted only at admission"
        hit = len(computed) + ext
        num_tokens = request.num_kv_tokens + hit * self.block_size + num_new_tokens
        needed = self.num_blocks_for(num_tokens) - len(blocks) - len(computed)
        short = needed - self.num_free_blocks_adopting(computed)
        if short > 0 and self.segments is not None:  # idle segment entries go first
            short -= self.segments.release(short)
        if short > 0 and self.soft_pins:  # then soft pins, before any request waits
            short -= self.release_soft_pins(short)
        if short > 0:
            return None
        if self.cache is not None and request.num_computed_tokens == 0 and not blocks:
            self.prefix_query_tokens += request.num_tokens
            self.prefix_hit_tokens += hit * self.block_size
        if computed:
            self.pool.touch(computed)
            assert self.cache is not None
            self.cache.on_hit(computed)
        blocks = self.req_blocks.setdefault(rid, blocks)
        blocks.extend(computed)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        if ext:
            self._external[rid] = (len(computed), hit)
        # Only real tokens are hashed: draft rows (speculative decoding) are unverified.
        self._cache_full_blocks(request, min(num_tokens, request.num_tokens))
        if ext and self.cache is not None:
            self.cache.on_hit([b for b in blocks[len(computed) : hit] if b.block_hash is not None])
        return [b.block_id for b in blocks]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks completely covered by the first ``num_tokens`` tokens."""
        if self.cache is None or request.press_applied:
            return  # a pressed request's blocks no longer hold a token prefix
        if request.cacheable_tokens is not None:  # placed segments: not a true prefix
            num_tokens = min(num_tokens, request.cacheable_tokens)
        num_full = num_tokens // self.block_size
        rid = request.request_id
        if num_full <= self._num_inserted.get(rid, 0):
            return
        hashes = self.block_hashes(request)[:num_full]
        blocks = self.req_blocks[rid]
        start = self._num_inserted.get(rid, 0)
        new = self._new_cached
        fresh = [b.block_hash is None for b in blocks[start:num_full]] if new is not None else []
        self.cache.insert(
            request.all_token_ids, hashes, blocks, self.root_of(request), request.cache_salt
        )
        self._num_inserted[rid] = num_full
        if new is not None:
            first, end = self._external.get(rid, (0, 0))
            for i, was_free in enumerate(fresh, start):
                loaded = first <= i < end  # its KV came from a tier: nothing to store
                if was_free and not loaded and blocks[i].block_hash == hashes[i]:
                    new.append((hashes[i], [blocks[i]]))

    # ------------------------------------------------------------------ offload connector
    def admission_cost(
        self,
        request: Request,
        computed: Sequence[KVCacheBlock],
        num_external_blocks: int,
        num_new_tokens: int,
    ) -> int:
        hit = len(computed) + num_external_blocks
        total = self.num_blocks_for(request.num_kv_tokens + hit * self.block_size + num_new_tokens)
        return total - len(computed) + sum(1 for b in computed if b.ref_cnt == 0)

    def logical_pages(self, request_id: str, first: int, end: int) -> list[list[int | None]]:
        return [[b.block_id] for b in self.req_blocks[request_id][first:end]]

    def page_keys(self, block_hash: BlockHash) -> list[BlockHash]:
        return [block_hash]

    # ------------------------------------------------------------------ presses
    def replace_blocks(self, request: Request, tables: Sequence[Sequence[int]]) -> int:
        """A press compacted the request's KV into ``tables[0]`` (blocks from
        ``allocate_blocks``; one table, this manager has one KV group): release the old
        ones (tail first) and return how many blocks went back to the pool.

        The old blocks keep their prefix-cache entries: they still hold the *unpressed*
        KV of a true prefix, so other requests reuse them unchanged.
        """
        (block_ids,) = tables
        rid = request.request_id
        old = self.req_blocks[rid]
        self.req_blocks[rid] = [self.pool.blocks[i] for i in block_ids]
        self.pool.free(reversed(old))
        self._external.pop(rid, None)  # tier-loaded indices name the old table
        return len(old) - len(block_ids)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def group_block_ids(self, request_id: str) -> None:
        """One table for every layer (``kv/hybrid.py`` has one per KV group)."""

    def free(self, request: Request | str) -> None:
        """Release all blocks of a request (tail first). Idempotent."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self._num_inserted.pop(rid, None)
        self._external.pop(rid, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def rollback_slots(self, request: Request) -> int:
        """Speculative decoding rejected draft rows: keep the blocks up to the slot of the
        request's last token (its KV comes next step), free the ones after it (tail
        first); returns how many. Blocks past the last token held only draft rows: never
        hashed (``allocate_slots`` hashes real tokens only), never shared::

            slots:   [t t t t][t t d d][d d . .]     d = rejected draft row
            kept:    [t t t t][t t d d]              the stale d slots are written again
            freed:                     [d d . .]
        """
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return 0
        keep = cdiv(request.num_tokens - request.num_dropped, self.block_size)
        tail = blocks[keep:]
        for b in tail:
            assert b.block_hash is None and b.ref_cnt == 1, f"block {b.block_id} is shared"
        del blocks[keep:]
        self.pool.free(reversed(tail))
        return len(tail)

    def waste_slots(self, running: Iterable[Request]) -> int:
        """Reserved slots not (yet) written: each request's tail-block slack."""
        bs = self.block_size
        return sum(
            len(self.req_blocks.get(r.request_id, ())) * bs - r.num_kv_tokens
            for r in running
            if r.request_id in self.req_blocks
        )

    # ------------------------------------------------------------------ pins & reset
    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Hold the cached blocks of ``token_ids`` so they are never evicted; returns tokens pinned.

        Only full blocks are pinned. Raises ``InvalidRequestError`` when the prefix is
        not cached (compute it first, as ``LLM.pin_prefix`` does), is shorter than a
        block, or would push pinned blocks past ``max_pinned_fraction`` of the pool.
        """
        self.check_pinnable(len(token_ids))
        hashes = self.prefix_hashes(token_ids, cache_salt)
        if hashes[-1] in self.pins:
            self.soft_pins.pop(hashes[-1], None)  # pinned for good now
            return len(hashes) * self.block_size
        assert self.cache is not None
        root = root_hash(self.model_id, cache_salt)
        blocks = self.cache.match(token_ids, hashes, root)
        if len(blocks) < len(hashes):
            raise InvalidRequestError(
                f"only {len(blocks) * self.block_size} of the prefix's "
                f"{len(hashes) * self.block_size} block-aligned tokens are cached; "
                "run the prefix through the engine before pinning it"
            )
        self._hold_pin(hashes[-1], blocks)
        return len(hashes) * self.block_size

    def pin_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, max_fraction: float
    ) -> int:
        """Softly pin the longest cached full-block prefix of ``token_ids``; returns the
        tokens pinned (0: nothing cached, no prefix cache, or no room).

        A soft pin holds its blocks like a pin but is the first KV given back when the
        pool runs short (``allocate_slots`` releases soft pins, oldest first, before it
        fails), and soft pins together stay within ``max_fraction`` of the pool: older
        soft pins are released to make room. The server keeps a stored conversation's
        next-turn prefix this way (``serve/responses/store.py``). Invariant: every key of
        ``soft_pins`` is a key of ``pins``.
        """
        if self.cache is None or len(token_ids) < self.block_size:
            return 0
        hashes = self.prefix_hashes(token_ids, cache_salt)
        root = root_hash(self.model_id, cache_salt)
        blocks = self.cache.match(token_ids, hashes, root)
        limit = int(max_fraction * self.num_blocks)
        if not blocks or len(blocks) > limit:
            return 0
        key = hashes[len(blocks) - 1]
        if key in self.pins:
            return len(blocks) * self.block_size
        while self.soft_pins and self._soft_blocks() + len(blocks) > limit:
            self._release_oldest_soft_pin()
        try:
            self._hold_pin(key, blocks)
        except InvalidRequestError:  # the pins' overall limit: a soft pin is best effort
            return 0
        self.soft_pins[key] = None
        return len(blocks) * self.block_size

    def release_soft_pins(self, num_blocks: int) -> int:
        """Release soft pins, oldest first, until ``num_blocks`` more blocks are free
        (or none is left); returns how many blocks became free."""
        before = self.pool.num_free_blocks
        while self.soft_pins and self.pool.num_free_blocks - before < num_blocks:
            self._release_oldest_soft_pin()
            self.num_soft_pins_released += 1
        return self.pool.num_free_blocks - before

    def _release_oldest_soft_pin(self) -> None:
        key = next(iter(self.soft_pins))
        del self.soft_pins[key]
        self.pool.free(reversed(self.pins.pop(key)))

    def _soft_only_blocks(self) -> int:
        """Blocks that releasing every soft pin would free (held by soft pins alone)."""
        if not self.soft_pins:
            return 0
        holds: dict[int, int] = {}
        for key in self.soft_pins:
            for b in self.pins[key]:
                holds[b.block_id] = holds.get(b.block_id, 0) + 1
        blocks = {b.block_id: b for key in self.soft_pins for b in self.pins[key]}
        return sum(1 for i, n in holds.items() if blocks[i].ref_cnt == n)

    def _soft_blocks(self) -> int:
        return len({b.block_id for k in self.soft_pins for b in self.pins[k]})

    def check_pinnable(self, num_tokens: int) -> None:
        if self.cache is None:
            raise InvalidRequestError("pinning needs a prefix cache (--prefix-cache hash|radix)")
        if num_tokens < self.block_size:
            raise InvalidRequestError(
                f"a pinned prefix needs at least one full block ({self.block_size} tokens), "
                f"got {num_tokens}"
            )
        limit = int(self.max_pinned_fraction * self.num_blocks)
        if num_tokens // self.block_size > limit:
            raise InvalidRequestError(
                f"prefix of {num_tokens} tokens needs {num_tokens // self.block_size} blocks; "
                f"pins may hold at most {limit} (max_pinned_fraction "
                f"{self.max_pinned_fraction} of {self.num_blocks} blocks)"
            )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, pin and segment (``LLM.reset_prefix_cache``)."""
        if self.segments is not None:
            self.segments.reset()
        if self.cache is None:
            return
        self.release_pins()
        self.pool.reclaim(self.cache.reset())
        self._num_inserted.clear()
        if self.pool.residency is not None:
            self.pool.residency.reset()
        self._external.clear()

    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache entries of ``block_ids`` (a failed step wrote them;
        ``step_isolation.py``); pins and every other entry stay."""
        if self.cache is not None:
            self.pool.reclaim(self.cache.forget([self.pool.blocks[i] for i in block_ids]))

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        segs = self.segments.block_lists() if self.segments is not None else []
        for chain in (*self.req_blocks.values(), *self.pins.values(), *segs):
            for b in chain:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{held.get(block.block_id, 0)} request, pin and segment references"
            )
        if self.segments is not None:
            self.segments.check_integrity()
        for rid, blocks in self.req_blocks.items():
            assert len({b.block_id for b in blocks}) == len(blocks), f"{rid} holds a block twice"
        for rid, (first, end) in self._external.items():
            assert rid in self.req_blocks and 0 <= first <= end <= len(self.req_blocks[rid])
