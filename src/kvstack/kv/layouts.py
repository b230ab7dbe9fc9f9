"""``KV_LAYOUTS``: the ``--kv-layout`` registry, name -> ``KVManager`` factory.

``paged`` is vLLM's PagedAttention bookkeeping with the prefix cache, tiers and compression;
``contiguous`` and ``contiguous-request`` are the pre-paging baselines kept for measurement
(``kv/contiguous.py``). Every factory takes the same ``KVLayoutParams`` and returns an
object that satisfies ``kv/base.py``'s ``KVManager`` protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstack.core.registry import Registry
from kvstack.kv.base import KVManager
from kvstack.kv.contiguous import ContiguousKVManager
from kvstack.kv.groups import KVGroups
from kvstack.kv.hybrid import HybridKVManager
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.residency import BlockResidency


@dataclass(frozen=True)
class KVLayoutParams:
    """What a layout needs to size and run its bookkeeping (plain values, no config)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    prefix_cache: str = "hash"
    eviction_policy: str = "lru"
    max_pinned_fraction: float = 0.5
    model_id: str = ""
    residency: BlockResidency | None = None  # paged only: --kv-cache-metrics
    groups: KVGroups | None = None  # paged only: the hybrid manager's KV groups (pages)
    max_chunk_tokens: int = 0  # the step's token budget (a window group's peak)


KVLayoutFactory = Callable[[KVLayoutParams], KVManager]
KV_LAYOUTS: Registry[KVLayoutFactory] = Registry("kv_layout")


def _paged(p: KVLayoutParams) -> KVManager:
    if p.groups is not None:  # sliding-window layers: one table per group (kv/hybrid.py)
        return HybridKVManager(
            p.groups, p.num_blocks, p.block_size, p.max_chunk_tokens, p.prefix_cache,
            p.eviction_policy, p.model_id, residency=p.residency,
            max_pinned_fraction=p.max_pinned_fraction,
        )  # fmt: skip
    return KVCacheManager(
        p.num_blocks,
        p.block_size,
        prefix_cache=p.prefix_cache,
        eviction_policy=p.eviction_policy,
        max_pinned_fraction=p.max_pinned_fraction,
        model_id=p.model_id,
        residency=p.residency,
    )


def _contiguous(variant: str) -> KVLayoutFactory:
    def build(p: KVLayoutParams) -> KVManager:
        return ContiguousKVManager(p.num_blocks, p.block_size, p.max_model_len, variant)

    return build


KV_LAYOUTS.add("paged", _paged, "fixed-size blocks and block tables (default)")
KV_LAYOUTS.add(
    "contiguous",
    _contiguous("contiguous"),
    "pre-paging baseline: one slab of max-model-len tokens per request",
)
KV_LAYOUTS.add(
    "contiguous-request",
    _contiguous("contiguous-request"),
    "pre-paging baseline: one slab of prompt + max_tokens per request",
)


def build_kv_manager(layout: str, params: KVLayoutParams) -> KVManager:
    """The ``KVManager`` of ``--kv-layout layout``; ``ConfigError`` for an unknown name."""
    return KV_LAYOUTS.get(layout)(params)
