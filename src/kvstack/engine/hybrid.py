"""The engine's side of the hybrid KV manager (``kv/hybrid.py``, ``kv/groups.py``).

A model with sliding-window layers gets one block table per group of layers unless
``--disable-hybrid-kv-cache-manager`` (vLLM's flag) or a layout other than ``paged``
keeps one table for all layers. What the hybrid manager does not support is refused
at startup by ``HybridKVManager``, one error naming the option.
"""

from __future__ import annotations

from kvstack.config.engine import EngineConfig
from kvstack.core.model_config import ModelConfig
from kvstack.kv.groups import KVGroups


def plan_kv_groups(config: EngineConfig, mc: ModelConfig) -> KVGroups | None:
    """The model's KV groups when the hybrid manager runs it, else None."""
    cc = config.cache
    if not mc.has_window or cc.kv_layout != "paged" or cc.disable_hybrid_kv_cache_manager:
        return None
    return KVGroups.plan([mc.layer_window(i) for i in range(mc.num_layers)])


def num_pages(num_blocks: int, groups: KVGroups | None) -> int:
    """``--num-blocks`` counts blocks of every layer; the hybrid pool holds the same
    memory in pages of ``groups.layers_per_page`` layers."""
    return num_blocks if groups is None else num_blocks * groups.num_groups


def token_capacity(num_blocks: int, groups: KVGroups | None, block_size: int) -> int:
    """Tokens of one sequence the pool holds when every layer keeps every token."""
    per_block = 1 if groups is None else groups.num_groups
    return num_blocks // per_block * block_size
