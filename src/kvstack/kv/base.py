"""``KVManager``: the one interface the scheduler, engine and server see of KV bookkeeping.

Two implementations, chosen by ``--kv-layout`` (``kv/layouts.py``):

* ``KVCacheManager`` (``kv/manager.py``): paged blocks, a prefix cache,
  pins, the hooks offload tiers and presses use;
* ``ContiguousKVManager`` (``kv/contiguous.py``): the pre-paging baseline, one slab per
  request; no prefix cache, no pins.

The protocol is plain Python ints and lists (a design rule: nothing above the runner holds
tensors). Its contract, for every implementation:

* ``allocate_slots(request, n, computed)`` either grows the request's block table to cover
  ``num_kv_tokens + len(computed) * block_size + n`` slots and returns the whole table,
  or returns None and changes nothing (so the scheduler can preempt and retry);
* ``free`` is idempotent and releases everything ``allocate_slots`` gave;
* ``rollback_slots`` (speculative decoding) releases what lies past the slot of the
  request's last token after rejected draft rows; slots of unverified tokens are never
  hashed into the prefix cache, published as events or offloaded;
* ``get_computed_blocks`` changes nothing;
* after every public call ``check_integrity()`` holds.

``KVCacheStats`` is the snapshot ``stats()`` returns; ``KVRoutingInfo`` what a KV-aware
router needs to hash prompts the way this engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvstack.kv.events import KVEventLog

if TYPE_CHECKING:
    from kvstack.core.request import Request
    from kvstack.kv.block_pool import KVCacheBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for ``a`` tokens of ``b`` per block."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int  # plain free + evictable cached
    num_cached_blocks: int  # blocks holding reusable prefix KV (held or not)
    num_pinned_blocks: int
    usage: float  # 0..1, held blocks / all blocks
    num_requests: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evicted_blocks: int


@dataclass(frozen=True)
class KVRoutingInfo:
    """How this engine hashes prefixes (``kv/hashing.py``), for routers and KV events.

    ``model_id`` roots the hash chain; empty when the layout has no prefix cache.
    """

    model_id: str
    block_size: int
    prefix_cache: bool


class KVManager(Protocol):
    """Which KV blocks each request holds (see the module docstring for the contract)."""

    block_size: int
    events: KVEventLog
    block_unit: str  # what ``num_blocks`` counts, for messages ("KV blocks", "KV pages")

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def num_pinned_blocks(self) -> int: ...

    def routing_info(self) -> KVRoutingInfo: ...
    def num_blocks_for(self, num_tokens: int) -> int: ...
    def can_ever_fit(self, num_tokens: int) -> bool: ...
    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]: ...
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: Sequence[KVCacheBlock] = (),
        num_external_blocks: int = 0,
    ) -> list[int] | None: ...
    def get_block_ids(self, request_id: str) -> list[int]: ...
    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Per KV group, the block table (``kv/hybrid.py``); None: one table for all."""

    def held_request_ids(self) -> list[str]: ...
    def free(self, request: Request | str) -> None: ...
    def rollback_slots(self, request: Request) -> int: ...
    def waste_slots(self, running: Iterable[Request]) -> int: ...
    def check_pinnable(self, num_tokens: int) -> None: ...
    def pin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int: ...
    def unpin_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> bool: ...
    def pin_cached_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, max_fraction: float
    ) -> int: ...
    def cached_hashes(self) -> list[bytes]: ...
    def reset_prefix_cache(self) -> None: ...
    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache entries of blocks a failed step wrote (their KV may be
        half written); every other entry and pin stays. Held blocks stay held."""

    # KV compression: codecs with per-block state, and press compaction (paged layout only).
    def set_block_free_hook(self, hook: Callable[[int], None] | None) -> None: ...
    def allocate_blocks(self, n: int) -> list[int] | None: ...
    def release_blocks(self, block_ids: Sequence[int]) -> None: ...
    def replace_blocks(self, request: Request, tables: Sequence[Sequence[int]]) -> int: ...
    def stats(self) -> KVCacheStats: ...
    def check_integrity(self) -> None: ...
