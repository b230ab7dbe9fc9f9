"""The engine's side of segment reuse: set it up, check a request's marks.

``enable_segments`` gives the paged KV manager a ``SegmentCache`` (``kv/segments.py``)
and the scheduler its ``SegmentPlanner`` (``sched/segments.py``) unless
``--segment-cache none``. ``request_marks`` turns a request's ``[start, end)`` marks
into ``SegmentMarks`` or refuses them with one clear ``InvalidRequestError`` where
kvstack cannot place segments yet: the pre-paging layouts (no blocks to copy into), presses
(they drop the tokens a copy fills), the hybrid KV manager (window groups free the blocks
a copy would fill; a sliding-window model places segments with
``--disable-hybrid-kv-cache-manager``: one table, windows applied in attention) and kivi2
(a row reads its own block at full precision, which a copy has only as codes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import SamplingParams
from kvstack.core.segment_marks import SegmentMarks, make_marks
from kvstack.engine.parts import EngineParts
from kvstack.kv.hybrid import HybridKVManager
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.tiers.segments import SegmentTiers
from kvstack.sched.segments import SegmentPlanner

if TYPE_CHECKING:
    from kvstack.kv.segments import SegmentCache


def enable_segments(engine: EngineParts) -> None:
    """Attach the segment cache and planner (``--segment-cache`` not ``none``, paged
    layout); ``auto`` evicts entries in the order of ``--eviction-policy``."""
    cfg = engine.config.segments
    kv = engine.kv_manager
    if cfg.segment_cache == "none" or not isinstance(kv, KVCacheManager):
        return
    bos = engine.tokenizer.bos_token_id
    sink = [bos] if bos is not None else []  # the attention sink every segment follows
    policy = cfg.segment_cache
    if policy == "auto":  # the prefix cache's --eviction-policy
        policy = engine.config.cache.eviction_policy
    cache = kv.enable_segments(sink, cfg.segment_max_fraction, policy)
    planner = SegmentPlanner(cache, engine.model_config.name)
    planner.max_rows = engine.config.scheduler.max_num_batched_tokens - 1
    if engine.connector is not None:  # entries stored in and loaded from the offload tiers
        planner.tiers = SegmentTiers(engine.connector.offload, engine.kv_storage)
    engine.scheduler.segments = planner


def automatic_segments(engine: EngineParts) -> bool:
    """Whether the server turns tools, documents and marked parts into segments: the
    feature is on and nothing engine-wide refuses them (the hybrid KV manager, kivi2, a
    default press), so a chat request that never asked for segments cannot fail on them."""
    return (
        engine.scheduler.segments is not None
        and not engine.kv_storage.codec.own_block_exact
        and engine.config.cache.kv_press is None
    )


def request_marks(
    engine: EngineParts,
    spans: Sequence[Sequence[Any]] | None,
    ids: list[int],
    sp: SamplingParams,
    press: Any,
) -> SegmentMarks | None:
    """A request's checked marks; None when it has none or the feature is off. With
    ``prompt_logprobs`` the positions a copy fills have no entry (None, like position 0):
    ``LLM.score`` measures what the copies change on the tokens after them."""
    if spans is None:
        return None
    if isinstance(spans, str | bytes) or not isinstance(spans, Sequence):
        raise InvalidRequestError("segments: a list of [start, end) token ranges")
    cfg = engine.config.segments
    planner = engine.scheduler.segments
    if not spans or cfg.segment_cache == "none":
        return None
    if planner is None and isinstance(engine.kv_manager, HybridKVManager):
        raise InvalidRequestError(
            "segments are not supported by the hybrid KV manager (a sliding-window model) "
            "yet; start the server with --disable-hybrid-kv-cache-manager"
        )
    if planner is None:
        raise InvalidRequestError("segments need the paged KV layout (--kv-layout paged)")
    if engine.kv_storage.codec.own_block_exact:
        raise InvalidRequestError("segments are not supported with --kv-cache-dtype kivi2 yet")
    if press is not None:
        raise InvalidRequestError("segments cannot be combined with a KV press")
    ratio = sp.segment_recompute_ratio
    first = sp.segment_recompute_tokens
    cache = planner.cache
    room = int(cfg.segment_max_fraction * cache.pool.num_blocks) * cache.block_size
    budget = engine.config.scheduler.max_num_batched_tokens
    max_tokens = min(budget, room) - len(cache.sink)
    marks = make_marks(
        spans,
        len(ids),
        max_tokens,
        cfg.segment_recompute_ratio if ratio is None else ratio,
        cfg.segment_recompute_tokens if first is None else first,
        engine.model_config.vocab_size,
    )
    if marks is not None:
        marks = _fitting_primers(marks, len(cache.sink), cache.block_size, budget, max_tokens)
        cap = int(cfg.segment_max_fraction * cache.pool.num_blocks)
        need = _blocks_needed(marks, cache)
        if need > cap and marks.primers:  # without the primers' blocks, if that fits
            marks = replace(marks, primers=())
            need = _blocks_needed(marks, cache)
        if need > cap:
            raise InvalidRequestError(
                f"the request's segments need {need} KV blocks together; segments may "
                f"hold at most {cap} (--segment-max-fraction of {cache.pool.num_blocks})"
            )
    return marks


def _fitting_primers(
    marks: SegmentMarks, sink: int, bs: int, budget: int, max_tokens: int
) -> SegmentMarks:
    """``marks`` without the primers one step cannot compute: a primer only improves
    what a copy holds, so one whose shared lead (its whole blocks) exceeds the step's
    token budget, or whose last partial block with the segment exceeds a segment's
    limit, is dropped rather than refused (a server with a small
    ``--max-num-batched-tokens`` still reuses tools)."""
    if not marks.primers:
        return marks
    kept = []
    for (a, b), primer in zip(marks.spans, marks.primers, strict=True):
        lead = sink + len(primer)
        fits = lead - lead % bs <= budget and b - a + lead % bs - sink <= max_tokens
        kept.append(primer if fits else ())
    return replace(marks, primers=tuple(kept) if any(kept) else ())


def _blocks_needed(marks: SegmentMarks, cache: SegmentCache) -> int:
    """Blocks the request's entries hold together, with each shared lead's once."""
    sink, bs = len(cache.sink), cache.block_size
    leads = [sink + len(p) for p in {marks.primer(i) for i in range(len(marks.spans))}]
    own = sum(
        cache.blocks_for(b - a, sink + len(marks.primer(i))) for i, (a, b) in enumerate(marks.spans)
    )
    return own + sum(n // bs for n in leads)
