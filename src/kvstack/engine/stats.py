"""Engine counters: prefix hits, evictions, preemptions, KV usage and waste over time.

``waste`` is the fraction of the pool's token slots that are *reserved but not
written*, averaged over time (each step weighted by its wall time):

    waste(t) = sum over running requests of (slots reserved - tokens written) / pool slots

Paged allocation reserves at most one partly filled block per request; a contiguous
slab reserves a whole ``max_model_len``. Cached-but-idle prefix blocks are
not waste: they hold written KV that a later request may reuse.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstack.kv.tiers.base import TierStats


@dataclass(frozen=True)
class EngineStats:
    num_steps: int
    num_running: int
    num_waiting: int
    max_num_running: int  # peak concurrency
    num_preemptions: int
    prefill_tokens_computed: int  # prompt positions run through the model
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float  # hit tokens / query tokens (0 when no query)
    num_evicted_blocks: int
    num_cached_blocks: int
    num_pinned_blocks: int
    kv_usage: float  # now, 0..1
    kv_usage_avg: float  # time-averaged
    kv_waste_avg: float  # time-averaged, 0..1
    kv_waste_peak: float
    # Tiers: counters per offload tier ("host", "disk", "redis"); empty without tiers.
    offload: dict[str, TierStats] = field(default_factory=dict)
    # KV compression: what the pool holds with its codec (``--kv-cache-dtype``).
    kv_capacity_tokens: int = 0
    kv_bytes_per_token: float = 0.0
    # Presses: requests compacted, tokens they dropped, blocks returned at once.
    num_pressed_requests: int = 0
    num_press_dropped_tokens: int = 0
    num_press_input_tokens: int = 0  # dropped / input = the share of KV presses removed
    num_reclaimed_blocks: int = 0
    num_represses: int = 0  # presses again while decoding, holding a budget
    # Presses left undone, by reason (no_free_blocks, window_incomplete, error).
    press_skipped: dict[str, int] = field(default_factory=dict)
    # PyTorch fallbacks where a C++ kernel was meant to run: [kernel, reason, count]
    # (``model/kernels/loader.py``; in this process, since it started).
    kernel_fallbacks: list[list[Any]] = field(default_factory=list)
    # Of num_waiting, those waiting on an offload-tier lookup (vLLM's "deferred" reason).
    num_waiting_deferred: int = 0
    # Speculative decoding (``spec/stats.py`` ``SpecDecodeStats.to_dict``); empty when off.
    spec_decode: dict[str, Any] = field(default_factory=dict)
    # Segment reuse (``kv/segments.py`` ``SegmentCounters``); empty when off.
    segments: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class UsageTracker:
    """Integrates KV usage and waste over wall time between engine steps."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._last: float | None = None
        self._usage = 0.0
        self._waste = 0.0
        self.waste_peak = 0.0
        self._time = 0.0
        self._cur_usage = 0.0
        self._cur_waste = 0.0

    def record(self, usage: float, waste: float, now: float | None = None) -> None:
        """Record the state that holds from ``now`` until the next call."""
        now = time.perf_counter() if now is None else now
        if self._last is not None:
            dt = now - self._last
            self._usage += self._cur_usage * dt
            self._waste += self._cur_waste * dt
            self._time += dt
        self._last = now
        self._cur_usage, self._cur_waste = usage, waste
        self.waste_peak = max(self.waste_peak, waste)

    def pause(self, now: float | None = None) -> None:
        """Stop the clock (the engine went idle); the next ``record`` restarts it."""
        self.record(0.0, 0.0, now)
        self._last = None

    @property
    def usage_avg(self) -> float:
        return self._usage / self._time if self._time > 0 else self._cur_usage

    @property
    def waste_avg(self) -> float:
        return self._waste / self._time if self._time > 0 else self._cur_waste
