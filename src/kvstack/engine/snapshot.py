"""``LLMEngine.stats()``: one snapshot of the engine's counters (``engine/stats.py``)."""

from __future__ import annotations

from dataclasses import asdict

from kvstack.engine.parts import EngineParts
from kvstack.engine.stats import EngineStats
from kvstack.kv.base import KVCacheStats
from kvstack.model.kernels.loader import fallback_counts


def engine_stats(engine: EngineParts, kv: KVCacheStats) -> EngineStats:
    """``LLMEngine.stats``: the engine's counters with the KV snapshot ``kv``."""
    self = engine
    sched = self.scheduler
    press = self.press.counters
    seg = sched.segments
    return EngineStats(
        num_steps=self.num_steps,
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        num_waiting_deferred=sched.num_waiting_deferred,
        max_num_running=sched.max_num_running,
        num_preemptions=sched.num_preemptions_total,
        prefill_tokens_computed=sched.num_prefill_tokens_computed,
        prefix_query_tokens=kv.prefix_query_tokens,
        prefix_hit_tokens=kv.prefix_hit_tokens,
        prefix_hit_rate=kv.prefix_hit_tokens / kv.prefix_query_tokens
        if kv.prefix_query_tokens
        else 0.0,
        num_evicted_blocks=kv.num_evicted_blocks,
        num_cached_blocks=kv.num_cached_blocks,
        num_pinned_blocks=kv.num_pinned_blocks,
        kv_usage=kv.usage,
        kv_usage_avg=self.usage_tracker.usage_avg,
        kv_waste_avg=self.usage_tracker.waste_avg,
        kv_waste_peak=self.usage_tracker.waste_peak,
        offload=self.connector.stats() if self.connector is not None else {},
        kv_capacity_tokens=kv.num_blocks * self.kv_manager.block_size,
        num_pressed_requests=press.pressed_requests,
        num_press_dropped_tokens=press.dropped_tokens,
        num_press_input_tokens=press.input_tokens,
        num_represses=press.represses,
        num_reclaimed_blocks=press.reclaimed_blocks,
        press_skipped=dict(press.skipped),
        kv_bytes_per_token=self.kv_bytes_per_token,
        kernel_fallbacks=[[k, r, n] for (k, r), n in fallback_counts().items()],
        spec_decode=self.speculator.stats.to_dict() if self.speculator is not None else {},
        segments=asdict(seg.cache.counters) if seg is not None else {},
    )
