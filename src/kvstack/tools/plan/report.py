"""The text report of ``kvstack plan`` (``--json`` prints the ``Plan`` fields instead)."""

from __future__ import annotations

from kvstack.tools.plan.sizing import Plan
from kvstack.tools.plan.specs import GB, GiB, MiB


def fmt_bytes(n: int) -> str:
    """``47,244,640,256 B (47.24 GB / 44.00 GiB)``; under 1 MiB in MiB."""
    if abs(n) < MiB:
        return f"{n:,} B ({n / MiB:.3f} MiB)"
    return f"{n:,} B ({n / GB:.2f} GB / {n / GiB:.2f} GiB)"


def format_plan(p: Plan) -> str:
    tp_s = f" × {p.tp}" if p.tp > 1 else ""
    rows = [
        ("model", f"{p.model} — {p.attention}"),
        ("gpu", f"{p.gpu}{tp_s}, {fmt_bytes(p.gpu_memory_bytes)} each, util "
         f"{p.gpu_memory_utilization:g}"),
        ("context", f"{p.context:,} tokens (model max {p.max_position_embeddings:,})"
         + ("  [OVER THE MODEL'S LIMIT]" if p.context > p.max_position_embeddings else "")),
        ("dtypes", f"KV {p.kv_cache_dtype}, weights {p.weights_dtype}"),
        ("KV per token", fmt_bytes(p.kv_bytes_per_token)),
        ("KV per request", fmt_bytes(p.kv_bytes_per_request)),
    ]  # fmt: skip
    if p.tp > 1:
        heads = f", {p.kv_heads_per_gpu} KV head(s)" if p.kv_heads_per_gpu else ""
        rows += [
            ("  per GPU/token", fmt_bytes(p.kv_bytes_per_token_per_gpu) + heads),
            ("  per GPU/request", fmt_bytes(p.kv_bytes_per_request_per_gpu)),
        ]
    est = " (estimated params)" if p.params_estimated else ""
    rows += [
        ("weights / GPU", fmt_bytes(p.weights_bytes_per_gpu) + est),
        ("reserve / GPU", fmt_bytes(p.reserve_bytes_per_gpu) + " = max(1 GiB, 5% of memory)"),
        ("KV budget / GPU", fmt_bytes(p.kv_budget_bytes_per_gpu)),
        ("KV budget total", fmt_bytes(p.kv_budget_bytes_total)),
        ("requests that fit", f"{p.max_concurrent_requests} at {p.context:,} tokens"),
    ]
    if p.prefix_hit_rate:
        rows.append((f"  with {p.prefix_hit_rate:g} hit", str(p.effective_concurrent_requests)))
    th = p.autoscale_kv_usage_threshold
    rows.append(("scale out when", f"vllm:kv_cache_usage_perc > {th:.2f}" if th else "n/a"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in p.notes] + [f"WARNING: {w}" for w in p.warnings]
    return "\n".join(lines)
