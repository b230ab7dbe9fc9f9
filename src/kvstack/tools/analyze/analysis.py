"""The analysis of ``kvstack analyze``: replays at every cache size, shared prefixes, knees.

:func:`analyze` turns a parsed log (:mod:`.log`) into the JSON report that :mod:`.report`
formats: for each policy and cache size one :func:`~.replay.replay` through the engine's
own ``KVCacheManager``, the infinite-cache bound, the knee of each hit-rate curve and the
most reused shared prefixes (with their KV bytes when ``--model`` names a loadable model).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError, KvstackError
from kvstack.kv.hashing import BlockHash
from kvstack.tools.analyze.log import LogRequest, ParseResult
from kvstack.tools.analyze.replay import ALL_POLICIES, Prepared, prepare, replay
from kvstack.tools.analyze.report import find_knee

KNEE_TOLERANCE = 0.02


def shared_prefixes(
    requests: Sequence[LogRequest], prep: Prepared, block_size: int, top: int = 10
) -> list[dict[str, Any]]:
    """The longest block-aligned prefixes shared by >= 2 requests, most reused first.

    A prefix (a chain hash) is reported when at least two requests contain it and it is
    longer than every shared extension of it with the same frequency, i.e. no child
    prefix is contained in as many requests. Ranked by ``reuse_tokens`` = length x
    (frequency - 1), the prefill an infinite cache saves on it.
    """
    count: dict[BlockHash, int] = {}
    where: dict[BlockHash, tuple[int, int]] = {}  # first (request, block index)
    best_child: dict[BlockHash, int] = {}
    for i, hs in enumerate(prep.hashes):
        for b, h in enumerate(hs):
            count[h] = count.get(h, 0) + 1
            where.setdefault(h, (i, b))
    for hs in prep.hashes:
        for parent, child in itertools.pairwise(hs):
            if count[child] > best_child.get(parent, 0):
                best_child[parent] = count[child]
    out: list[dict[str, Any]] = []
    for h, c in count.items():
        if c >= 2 and best_child.get(h, 0) < c:
            i, b = where[h]
            length = (b + 1) * block_size
            out.append(
                {
                    "length_tokens": length,
                    "frequency": c,
                    "reuse_tokens": length * (c - 1),
                    "first_line": requests[i].line_no,
                    "head_token_ids": requests[i].token_ids[: min(length, 8)].tolist(),
                }
            )
    out.sort(key=lambda d: (-d["reuse_tokens"], -d["length_tokens"], d["first_line"]))
    return out[:top]


def ideal_hit_rate(requests: Sequence[LogRequest], prep: Prepared, block_size: int) -> float:
    """Token hit rate of an infinite cache (every earlier full block is reusable)."""
    seen: set[BlockHash] = set()
    hits = total = 0
    for i, r in enumerate(requests):
        for h in prep.needs[i]:
            if h not in seen:
                break
            hits += block_size
        seen.update(prep.hashes[i])
        total += len(r.token_ids)
    return hits / total if total else 0.0


def segment_rates(
    requests: Sequence[LogRequest], prep: Prepared, block_size: int
) -> dict[str, float] | None:
    """With an infinite cache (segment reuse): the share of segment tokens whose segment an
    earlier request already held, and the share of all prompt tokens segment reuse adds
    to prefix reuse (hit segment tokens past each request's ideal prefix hit). None when
    the log marks no segment."""
    if not any(r.segments for r in requests):
        return None
    seen_blocks: set[BlockHash] = set()
    seen_segments: set[bytes] = set()
    seg_total = seg_hits = beyond = total = 0
    for i, r in enumerate(requests):
        prefix = 0
        for h in prep.needs[i]:
            if h not in seen_blocks:
                break
            prefix += block_size
        for start, end in r.segments or ():
            key = r.token_ids[start:end].tobytes()
            seg_total += end - start
            if key in seen_segments:
                seg_hits += end - start
                beyond += max(0, end - max(start, prefix))
            seen_segments.add(key)
        seen_blocks.update(prep.hashes[i])
        total += len(r.token_ids)
    return {
        "segment_hit_rate": round(seg_hits / seg_total, 6) if seg_total else 0.0,
        "segment_gain": round(beyond / total, 6) if total else 0.0,
    }


def auto_cache_sizes(requests: Sequence[LogRequest], prep: Prepared, bs: int) -> list[int]:
    """Up to 8 geometric sizes (block multiples) from one that fits the largest request to
    one that holds every distinct block next to the largest request (an infinite cache)."""
    distinct = len({h for hs in prep.hashes for h in hs})
    largest = max((-(-len(r.token_ids) // bs) for r in requests), default=1)
    lo, hi = largest, max(distinct + largest, largest)
    n = 8
    ratio = (hi / lo) ** (1 / (n - 1))
    return sorted({round(lo * ratio**k) * bs for k in range(n)})


def model_kv_bytes_per_token(model: str | Path, dtype_bytes: int) -> int | None:
    """KV bytes per token of ``model`` from its config alone, or None if not loadable."""
    try:
        from kvstack.model.loader.gguf import read_gguf_config
        from kvstack.model.loader.registry import model_format, resolve_model_path
        from kvstack.model.loader.safetensors import config_from_hf, read_hf_config

        path = resolve_model_path(model)
        if model_format(path) == "gguf":
            cfg = read_gguf_config(path)
        else:
            cfg = config_from_hf(read_hf_config(path), path)
        return cfg.kv_bytes_per_token(dtype_bytes)
    except (KvstackError, OSError, ValueError, KeyError):
        return None


@dataclass
class AnalyzeOptions:
    block_size: int = 16
    cache_sizes: list[int] | None = None  # tokens; None: auto
    policies: tuple[str, ...] = ALL_POLICIES
    model: str | None = None
    kv_dtype_bytes: int = 2
    progress: bool = False


def analyze(parsed: ParseResult, opts: AnalyzeOptions) -> dict[str, Any]:
    """The JSON report of a parsed log (see ``report.format_report``)."""
    bs = opts.block_size
    if bs < 1:
        raise ConfigError(f"block size must be >= 1, got {bs}")
    reqs = parsed.requests
    prep = prepare(reqs, bs)
    sizes = sorted(set(opts.cache_sizes)) if opts.cache_sizes else auto_cache_sizes(reqs, prep, bs)
    for s in sizes:
        if s < bs:
            raise ConfigError(f"cache size {s} tokens is smaller than one block ({bs} tokens)")
    bar = None
    tick: Callable[[], None] | None = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(opts.policies) * len(sizes) * len(reqs), desc="replay", leave=False)
        tick = bar.update
    try:
        results = [
            replay(reqs, p, s, bs, prep, tick).to_json() for p in opts.policies for s in sizes
        ]
    finally:
        if bar is not None:
            bar.close()
    prompt_tokens = sum(len(r.token_ids) for r in reqs)
    knees = {}
    for p in opts.policies:
        curve = [(r["cache_size_tokens"], r["token_hit_rate"]) for r in results if r["policy"] == p]
        knees[p] = find_knee(curve, KNEE_TOLERANCE)
    prefixes = shared_prefixes(reqs, prep, bs)
    kvb = model_kv_bytes_per_token(opts.model, opts.kv_dtype_bytes) if opts.model else None
    if kvb is not None:
        for d in prefixes:
            d["kv_bytes"] = d["length_tokens"] * kvb
    cached = [r.num_cached_tokens for r in reqs]
    report: dict[str, Any] = {
        "version": 1,
        "block_size": bs,
        "num_requests": len(reqs),
        "num_prompt_tokens": prompt_tokens,
        "num_sessions": len({r.session_id for r in reqs if r.session_id is not None}),
        "num_lines": parsed.num_lines,
        "num_malformed_lines": parsed.num_malformed,
        "malformed_lines": [{"line": n, "error": e} for n, e in parsed.malformed],
        "ordered_by": parsed.ordered_by,
        "cache_sizes": sizes,
        "policies": list(opts.policies),
        "ideal_hit_rate": round(ideal_hit_rate(reqs, prep, bs), 6),
        "results": results,
        "knees": knees,
        "knee_tolerance": KNEE_TOLERANCE,
        "shared_prefixes": prefixes,
        "notes": [
            "the last prompt token is never reused (a hit covers at most (n-1)//block_size "
            "blocks), as in the engine",
            "a hit block is within-session when the first request that stored it has the "
            "same session id",
        ],
    }
    if kvb is not None:
        report["kv_bytes_per_token"] = kvb
    if (seg := segment_rates(reqs, prep, bs)) is not None:
        report |= seg
    if reqs and all(c is not None for c in cached):
        report["observed_hit_rate"] = round(
            sum(c or 0 for c in cached) / prompt_tokens if prompt_tokens else 0.0, 6
        )
    return report
