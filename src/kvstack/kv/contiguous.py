"""Pre-paging baseline: one contiguous KV slab per request, reserved up front.

Before PagedAttention (Kwon et al., SOSP 2023), engines such as FasterTransformer and
early HF serving reserved for each request a contiguous region large enough for the
longest sequence it might reach. The vLLM paper measured that only 20-38 % of that
memory held actual token states; the rest was reserved-but-unwritten slots (internal
fragmentation) and gaps between slabs (external fragmentation).

Two variants, selectable for measurement (``--kv-layout``):

* ``contiguous``: a slab of ``max_model_len`` tokens per request (the classic case);
* ``contiguous-request``: a slab of ``prompt + max_tokens`` tokens (an engine that
  trusts the client's ``max_tokens``; still wastes what the request does not generate).

The slab is a run of consecutive block ids, so the same storage, runner and attention
serve all eras; only the allocation policy differs. Free runs are kept as sorted
``(start, length)`` extents and allocated first-fit; a request is admitted only if a
run long enough exists, so fragmentation limits concurrency exactly as it would::

    blocks: [AAAAAAAA........][BBBBBBBB........][free...................]
             ^ slab of A        written ^ reserved but unwritten (waste)

Invariants (``check_integrity``): extents and slabs are disjoint, in range, and
cover the pool; free extents are sorted and merged.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.kv.base import KVCacheStats, KVRoutingInfo, cdiv
from kvstack.kv.events import KVEventLog

if TYPE_CHECKING:
    from kvstack.core.request import Request
    from kvstack.kv.block_pool import KVCacheBlock


class ContiguousKVManager:
    """``KVManager`` (``kv/base.py``) of the pre-paging baseline: no prefix cache, no pins."""

    block_unit = "KV blocks"

    enable_prefix_caching = False
    cache = None
    prefix_query_tokens = 0
    prefix_hit_tokens = 0
    num_pinned_blocks = 0

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, variant: str = "contiguous"
    ) -> None:
        if variant not in ("contiguous", "contiguous-request"):
            raise ConfigError(f"unknown contiguous variant {variant!r}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.variant = variant
        self.events = KVEventLog(enabled=False)
        self.free_extents: list[tuple[int, int]] = [(0, num_blocks)]  # (start, length)
        self.slabs: dict[str, tuple[int, int]] = {}

    def held_request_ids(self) -> list[str]:
        """Requests holding KV (the scheduler checks that only running ones do)."""
        return list(self.slabs)

    def routing_info(self) -> KVRoutingInfo:
        return KVRoutingInfo(model_id="", block_size=self.block_size, prefix_cache=False)

    def cached_hashes(self) -> list[bytes]:
        return []

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def slab_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        if self.variant == "contiguous":
            return self.max_model_len
        return num_prompt_tokens + max_tokens

    def can_ever_fit(self, num_tokens: int) -> bool:
        slab = self.max_model_len if self.variant == "contiguous" else num_tokens
        return self.num_blocks_for(slab) <= self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return sum(n for _, n in self.free_extents)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        return []

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        num_external_blocks: int = 0,
    ) -> list[int] | None:
        assert not computed and not num_external_blocks, "the contiguous layout has no hits"
        rid = request.request_id
        slab = self.slabs.get(rid)
        if slab is None:
            need = self.num_blocks_for(
                self.slab_tokens(request.num_prompt_tokens, request.max_tokens)
            )
            fits = [i for i, (_, length) in enumerate(self.free_extents) if length >= need]
            if not fits:
                return None
            i = fits[0]  # first fit
            start, length = self.free_extents[i]
            if length == need:
                del self.free_extents[i]
            else:
                self.free_extents[i] = (start + need, length - need)
            slab = (start, need)
            self.slabs[rid] = slab
        start, length = slab
        if request.num_computed_tokens + num_new_tokens > length * self.block_size:
            raise InvalidRequestError(f"request {rid} outgrew its contiguous slab")
        return list(range(start, start + length))

    def get_block_ids(self, request_id: str) -> list[int]:
        slab = self.slabs.get(request_id)
        return [] if slab is None else list(range(slab[0], slab[0] + slab[1]))

    def group_block_ids(self, request_id: str) -> None:
        """One slab for every layer."""

    def free(self, request: Request | str) -> None:
        rid = request if isinstance(request, str) else request.request_id
        slab = self.slabs.pop(rid, None)
        if slab is None:
            return
        i = bisect.bisect_left(self.free_extents, slab)
        self.free_extents.insert(i, slab)
        # Merge with the right, then the left neighbour.
        if i + 1 < len(self.free_extents):
            s, n = self.free_extents[i]
            s2, n2 = self.free_extents[i + 1]
            if s + n == s2:
                self.free_extents[i : i + 2] = [(s, n + n2)]
        if i > 0:
            s0, n0 = self.free_extents[i - 1]
            s, n = self.free_extents[i]
            if s0 + n0 == s:
                self.free_extents[i - 1 : i + 1] = [(s0, n0 + n)]

    def rollback_slots(self, request: Request) -> int:
        """A slab is reserved whole up front: rejected draft slots stay in it and are
        written again by the next step; no block changes hands (returns 0)."""
        return 0

    def waste_slots(self, running: Iterable[Request]) -> int:
        bs = self.block_size
        return sum(
            self.slabs[r.request_id][1] * bs - r.num_computed_tokens
            for r in running
            if r.request_id in self.slabs
        )

    def check_pinnable(self, num_tokens: int) -> None:
        raise InvalidRequestError("pinning needs the paged layout with a prefix cache")

    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        self.check_pinnable(len(token_ids))
        return 0

    def unpin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool:
        return False

    def pin_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, max_fraction: float
    ) -> int:
        return 0  # no prefix cache in this layout: nothing to keep for a next turn

    def reset_prefix_cache(self) -> None:
        return None

    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        return None  # no prefix cache

    # Codecs and presses need the paged layout (``CacheConfig`` refuses them earlier).
    def set_block_free_hook(self, hook: Callable[[int], None] | None) -> None:
        if hook is not None:
            raise ConfigError("--kv-cache-dtype needs the paged layout (--kv-layout paged)")

    def allocate_blocks(self, n: int) -> list[int] | None:
        raise InvalidRequestError("KV presses need the paged layout")

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        raise InvalidRequestError("KV presses need the paged layout")

    def replace_blocks(self, request: Request, tables: Sequence[Sequence[int]]) -> int:
        raise InvalidRequestError("KV presses need the paged layout")

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=0,
            num_pinned_blocks=0,
            usage=self.usage,
            num_requests=len(self.slabs),
            prefix_query_tokens=0,
            prefix_hit_tokens=0,
            num_evicted_blocks=0,
        )

    def check_integrity(self) -> None:
        spans = sorted([*self.free_extents, *self.slabs.values()])
        pos = 0
        for start, length in spans:
            assert length > 0, "empty extent"
            assert start == pos, f"gap or overlap at block {pos} (next span starts at {start})"
            pos = start + length
        assert pos == self.num_blocks, f"spans cover {pos} of {self.num_blocks} blocks"
        for (s, n), (s2, _) in zip(self.free_extents, self.free_extents[1:], strict=False):
            assert s + n < s2, "free extents not sorted and merged"
