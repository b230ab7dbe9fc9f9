"""One snapshot of what the KV cache holds, for the web view (``GET /v1/kv/state``).

``build_state`` runs on the engine thread (``AsyncEngine.kv_state``), between steps, so
it reads the KV manager and the scheduler without locks. It returns plain JSON-ready
dicts::

    {"ts", "block_size", "prefix_cache", "eviction_policy",
     "blocks": BlockView.to_dict() (kv/block_view.py; at most max_cells cells),
     "tiers": {"host": {"num_blocks", "hits", "stores", ...}, ...},   # configured tiers
     "counters": {"kv_usage", "prefix_hit_rate", "num_running", "num_waiting",
                  "num_evicted_blocks", "num_cached_blocks", "num_pinned_blocks",
                  "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", ...},
     "running": [{"id", "prompt_tokens", "computed", "cached_tokens", "pressed_tokens",
                  "output_tokens"}, ...],                           # at most MAX_RUNNING
     "recent": [RecentRequest as a dict, ...]}                      # newest last

``RecentRequests`` keeps the last ``capacity`` finished requests (a bounded deque,
filled on the engine thread when a request finishes, O(1) each): where each one's
prompt KV came from (device prefix hit, offload tier, cached segment, computed), how
many tokens a press dropped, its latencies, and the first characters of its output.
TTFT and ITL percentiles are over those requests.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstack.core.request import RequestOutput
from kvstack.engine.llm_engine import LLMEngine
from kvstack.engine.stats import EngineStats
from kvstack.kv.block_view import view_blocks
from kvstack.kv.hybrid import HybridKVManager
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.press import PRESSES

MAX_RUNNING = 64  # running requests listed in one snapshot
OUTPUT_CHARS = 200  # characters of a finished request's output kept
PROMPT_HEAD_TOKENS = 1024  # prompt tokens kept per request for the prefix tree


@dataclass(frozen=True)
class RecentRequest:
    id: str
    endpoint: str
    finished_at: float  # wall clock (time.time)
    prompt_tokens: int
    device_hit_tokens: int  # prompt tokens whose KV was in the device prefix cache
    tier_tokens: dict[str, int]  # prompt tokens loaded from each offload tier
    computed_tokens: int  # prompt tokens run through the model
    segment_tokens: int  # prompt tokens copied from cached segments
    pressed_tokens: int  # tokens whose KV a press dropped (token eviction)
    output_tokens: int
    ttft_s: float | None
    itl_s: float | None  # mean inter-token latency of the request
    finish_reason: str | None
    output: str
    salted: bool  # had a cache_salt: its prefix is a tenant's, never listed in the tree
    # The first PROMPT_HEAD_TOKENS prompt ids (the prefix tree hashes them; not sent).
    prompt_head: tuple[int, ...] = field(default=(), repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["prompt_head"]
        return d


def _percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) by nearest rank; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


class RecentRequests:
    """The last ``capacity`` finished requests (engine thread only)."""

    def __init__(self, capacity: int = 256) -> None:
        self.items: deque[RecentRequest] = deque(maxlen=capacity)

    def add(
        self, out: RequestOutput, endpoint: str, first: float | None, last: float | None,
        arrival: float, reason: str | None, salted: bool = False,
    ) -> None:  # fmt: skip
        """Record a finished request (monotonic ``first``/``last`` token and ``arrival``)."""
        n_prompt = len(out.prompt_token_ids)
        by_tier = dict(out.cached_tokens_by_tier or {})
        device = by_tier.pop("device", out.num_cached_tokens if not by_tier else 0)
        n_out = sum(len(c.token_ids) for c in out.outputs)
        itl = None
        if first is not None and last is not None and n_out > 1:
            itl = (last - first) / (n_out - 1)
        text = out.outputs[0].text if out.outputs else ""
        self.items.append(
            RecentRequest(
                out.request_id, endpoint, time.time(), n_prompt, device, by_tier,
                max(0, n_prompt - out.num_cached_tokens - out.num_segment_tokens),
                out.num_segment_tokens, out.num_pressed_tokens, n_out,
                None if first is None else first - arrival, itl, reason, text[:OUTPUT_CHARS],
                salted, tuple(out.prompt_token_ids[:PROMPT_HEAD_TOKENS]),
            )
        )  # fmt: skip

    def latency(self) -> dict[str, float | None]:
        ttft = [r.ttft_s for r in self.items if r.ttft_s is not None]
        itl = [r.itl_s for r in self.items if r.itl_s is not None]
        return {
            "ttft_p50": _percentile(ttft, 0.5), "ttft_p99": _percentile(ttft, 0.99),
            "itl_p50": _percentile(itl, 0.5), "itl_p99": _percentile(itl, 0.99),
        }  # fmt: skip

    def last(self, n: int) -> list[dict[str, Any]]:
        items = list(self.items)[-n:] if n > 0 else []
        return [r.to_dict() for r in items]


def _counters(s: EngineStats, recent: RecentRequests) -> dict[str, Any]:
    return {
        "kv_usage": s.kv_usage, "prefix_hit_rate": s.prefix_hit_rate,
        "prefix_query_tokens": s.prefix_query_tokens, "prefix_hit_tokens": s.prefix_hit_tokens,
        "num_running": s.num_running, "num_waiting": s.num_waiting,
        "num_evicted_blocks": s.num_evicted_blocks, "num_cached_blocks": s.num_cached_blocks,
        "num_pinned_blocks": s.num_pinned_blocks, "num_preemptions": s.num_preemptions,
        "num_press_dropped_tokens": s.num_press_dropped_tokens,
        "tier_hits": sum(t.hits for t in s.offload.values()),
        **recent.latency(),
    }  # fmt: skip


def build_state(
    engine: LLMEngine, stats: EngineStats, recent: RecentRequests, *, max_cells: int,
    num_recent: int = 32,
) -> dict[str, Any]:  # fmt: skip
    """The snapshot described in the module docstring (engine thread only)."""
    kv = engine.kv_manager
    sched = engine.scheduler
    running = sched.running
    pressed = {r.request_id for r in running if r.press_applied}
    cc = engine.config.cache
    state: dict[str, Any] = {
        "ts": time.time(),
        "block_size": kv.block_size,
        "prefix_cache": cc.prefix_cache if kv.enable_prefix_caching else "none",
        "eviction_policy": cc.eviction_policy,
        "kv_layout": cc.kv_layout,
        "presses": list(PRESSES.names()),
        "tiers": {name: asdict(t) for name, t in stats.offload.items()},
        "counters": _counters(stats, recent),
        "running": [
            {
                "id": r.request_id,
                "prompt_tokens": r.num_prompt_tokens,
                "computed": r.num_computed_tokens,
                "cached_tokens": r.num_cached_tokens,
                "pressed_tokens": r.num_dropped,
                "output_tokens": len(r.output_token_ids),
            }
            for r in running[:MAX_RUNNING]
        ],
        "recent": recent.last(num_recent),
    }
    if isinstance(kv, KVCacheManager | HybridKVManager):
        state["blocks"] = view_blocks(kv, max_cells, pressed).to_dict()
    else:  # the contiguous (pre-paging) layouts have no blocks to draw
        state["blocks"] = None
    return state
