"""Text report, knee, plot and regression check of ``kvstack analyze``.

Inspired by kv-cache-analyzer and vLLM's proposed ``analyze-prefix-cache``; the
``oracle`` curve is Belady's MIN (Belady, IBM Systems Journal, 1966).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError


def find_knee(curve: Sequence[tuple[int, float]], tolerance: float = 0.02) -> int | None:
    """Smallest cache size whose hit rate is within ``tolerance`` of the largest size's.

    ``curve`` holds ``(cache size, hit rate)`` pairs in any order; None when empty.
    """
    if not curve:
        return None
    pts = sorted(curve)
    target = pts[-1][1] - tolerance
    return next(size for size, rate in pts if rate >= target - 1e-12)


def check_cache_regression(
    report: dict[str, Any], baseline: dict[str, Any], tol: float
) -> list[str]:
    """Regressions of ``report`` against ``baseline``: one line per (policy, cache size)
    present in both whose token hit rate dropped by more than ``tol``."""

    def rates(rep: dict[str, Any]) -> dict[tuple[str, int], float]:
        out: dict[tuple[str, int], float] = {}
        for r in rep.get("results", []):
            try:
                out[(str(r["policy"]), int(r["cache_size_tokens"]))] = float(r["token_hit_rate"])
            except (KeyError, TypeError, ValueError):
                continue
        return out

    new, old = rates(report), rates(baseline)
    lines = []
    for key in sorted(new.keys() & old.keys()):
        drop = old[key] - new[key]
        if drop > tol + 1e-12:
            policy, size = key
            lines.append(
                f"{policy} @ {size} tokens: token hit rate {old[key]:.4f} -> {new[key]:.4f} "
                f"(-{drop:.4f} > tolerance {tol})"
            )
    return lines


def _size(tokens: int) -> str:
    return str(tokens)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_report(report: dict[str, Any]) -> str:
    """Human-readable summary of an ``analyze`` report."""
    out = []
    head = f"kvstack analyze: {report.get('log', '')}".rstrip(": ")
    out.append(head)
    out.append(
        f"  {report['num_requests']} requests ({report['num_sessions']} sessions), "
        f"{report['num_prompt_tokens']} prompt tokens, block size {report['block_size']}, "
        f"ordered by {report['ordered_by']}"
    )
    if report.get("num_malformed_lines"):
        out.append(f"  {report['num_malformed_lines']} malformed line(s) skipped")
    out.append(f"  ideal hit rate (infinite cache): {report['ideal_hit_rate']:.1%}")
    if "segment_hit_rate" in report:  # segment reuse: marked segments in the log
        out.append(
            f"  segments (infinite cache): {report['segment_hit_rate']:.1%} of segment tokens "
            f"reused; {report['segment_gain']:.1%} of prompt tokens beyond prefix reuse"
        )
    if "observed_hit_rate" in report:
        out.append(f"  hit rate the server observed: {report['observed_hit_rate']:.1%}")
    out.append("")
    out.append(
        f"  {'policy':<9}{'cache':>8}{'token hit':>11}{'req hit':>9}{'saved tok':>11}"
        f"{'within':>9}{'cross':>9}{'evicted':>9}"
    )
    for r in report["results"]:
        hits = r["hit_tokens"] or 1
        out.append(
            f"  {r['policy']:<9}{_size(r['cache_size_tokens']):>8}"
            f"{r['token_hit_rate']:>11.1%}{r['request_hit_rate']:>9.1%}"
            f"{r['prefill_tokens_saved']:>11}"
            f"{r['within_session_hit_tokens'] / hits if r['hit_tokens'] else 0:>9.0%}"
            f"{r['cross_session_hit_tokens'] / hits if r['hit_tokens'] else 0:>9.0%}"
            f"{r['evicted_blocks']:>9}"
            + (f"  ({r['oversized_requests']} too large)" if r["oversized_requests"] else "")
        )
    out.append("")
    tol = report.get("knee_tolerance", 0.02)
    knees = ", ".join(
        f"{p} {_size(k) if k is not None else '-'}" for p, k in report["knees"].items()
    )
    out.append(f"  knee (smallest size within {tol} of the largest's hit rate): {knees}")
    if report["shared_prefixes"]:
        out.append("")
        out.append("  top shared prefixes (length x frequency, first seen on line):")
        for d in report["shared_prefixes"]:
            mem = f", KV {_bytes(d['kv_bytes'])}" if "kv_bytes" in d else ""
            out.append(
                f"    {d['length_tokens']:>6} tokens x {d['frequency']:<5} "
                f"reuse {d['reuse_tokens']:>7} tokens{mem}  (line {d['first_line']})"
            )
    return "\n".join(out)


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """PNG of token hit rate vs cache size, one line per policy (matplotlib Agg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is a dev dependency
        raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from e
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in report["policies"]:
        pts = sorted(
            (r["cache_size_tokens"], r["token_hit_rate"])
            for r in report["results"]
            if r["policy"] == policy
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.axhline(report["ideal_hit_rate"], color="gray", linestyle=":", label="infinite cache")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache size (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"prefix-cache hit rate ({report['num_requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
