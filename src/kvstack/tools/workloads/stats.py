"""What a workload offers a prefix cache: :func:`ideal_hit_rate` and :func:`summarize`.

**Hit rate** = cached prompt tokens / prompt tokens. :func:`ideal_hit_rate` is its upper
bound with an infinite cache: for each request (rounds in order), the longest run of full
blocks that an earlier prompt already contained, never the whole prompt (as the engine, it
never reuses a prompt's last token).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvstack.core.errors import ConfigError
from kvstack.kv.hashing import hash_blocks, root_hash
from kvstack.tools.workloads.spec import WorkloadRequest


def ideal_hit_rate(requests: Sequence[WorkloadRequest], block_size: int = 16) -> float:
    """Prefix-cache hit rate with an infinite cache (the module docstring)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    root, seen = root_hash(), set()
    hits = total = 0
    for req in sorted(requests, key=lambda r: (r.round, r.arrival_index)):
        ids = req.prompt_token_ids
        hashes = hash_blocks(ids, block_size, root)
        for h in hashes[: max(0, len(ids) - 1) // block_size]:
            if h not in seen:
                break
            hits += block_size
        seen.update(hashes)
        total += len(ids)
    return hits / total if total else 0.0


def summarize(requests: Sequence[WorkloadRequest], block_size: int = 16) -> dict[str, Any]:
    """Counts, prompt-length stats, sessions, rounds and the ideal hit rate."""
    lens = [len(r.prompt_token_ids) for r in requests] or [0]
    return {
        "num_requests": len(requests),
        "prompt_tokens_total": sum(lens),
        "prompt_tokens_mean": round(statistics.fmean(lens), 2),
        "prompt_tokens_min": min(lens),
        "prompt_tokens_max": max(lens),
        "num_sessions": len({r.session_id for r in requests if r.session_id is not None}),
        "num_rounds": len({r.round for r in requests}),
        "block_size": block_size,
        "ideal_hit_rate": round(ideal_hit_rate(requests, block_size), 4),
    }
