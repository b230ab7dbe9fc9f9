"""Reporting for ``benchmarks/eras.py``: markdown tables and bar charts.

One PNG per workload, 2x2 panels (output tok/s, prefill tokens computed, KV waste %, prefix
hit rate), one bar per era. matplotlib is imported lazily (Agg backend): when it is
missing, :func:`plot_eras` prints a one-line note and returns False, and the benchmark
goes on without the figure.

Redraw the figures of a result file without rerunning anything::

    .venv/bin/python benchmarks/eras_plot.py benchmarks/results/eras-all-<date>.json
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

REFERENCE_ERA = "paged"


def settings_line(res: dict) -> str:
    """One line naming the workload and every setting that shaped its numbers."""
    s, w = res["settings"], res["workload_summary"]
    knobs = "".join(f", {k} {v}" for k, v in res["overrides"].items())
    return (
        f"{w['num_requests']} requests × {s['max_tokens']} new tokens (seed {s['seed']}{knobs}; "
        f"{w['prompt_tokens_mean']:.0f} prompt tokens on average, {w['num_rounds']} round(s), "
        f"ideal hit rate {w['ideal_hit_rate']:.2f}); KV {s['kv_cache_memory']}, max_model_len "
        f"{s['max_model_len']}, max_num_seqs {s['max_num_seqs']}, bf16, greedy, "
        f"median of {s['runs']} run(s)"
    )


def markdown_table(res: dict) -> str:
    """The eras of one workload run as a markdown table."""
    ref = res.get("reference_era") or REFERENCE_ERA
    lines = [
        f"| era | output tok/s | × {ref} | KV waste % | max concurrent | prefix hit rate "
        "| prefill tokens | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | preemptions "
        f"| same tokens as {ref} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in res["eras"]:
        if "error" in e:
            lines.append(f"| {e['era']} | failed: {e['error']} |" + " |" * 10)
            continue
        m = e["median"]
        lines.append(
            f"| {e['era']} | {m['output_tok_s']:.1f} | {e['tok_s_vs_ref']:.2f} "
            f"| {m['kv_waste_pct']:.1f} | {m['max_concurrent']:.0f} | {m['prefix_hit_rate']:.3f} "
            f"| {m['prefill_tokens_computed']:.0f} | {m['ttft_p50_ms']:.0f} "
            f"| {m['ttft_p99_ms']:.0f} | {m['e2e_p50_ms']:.0f} | {m['num_preemptions']:.0f} "
            f"| {e['same_output_as_ref'] * 100:.0f} % |"
        )
    return "\n".join(lines)


# (median key, panel title, scale applied to the value, value label format)
PANELS: tuple[tuple[str, str, float, str], ...] = (
    ("output_tok_s", "output tokens/s (higher is better)", 1.0, "{:.0f}"),
    ("prefill_tokens_computed", "prefill tokens computed (lower is better)", 1.0, "{:.0f}"),
    ("kv_waste_pct", "KV memory waste % (lower is better)", 1.0, "{:.1f}"),
    ("prefix_hit_rate", "prefix hit rate % (higher is better)", 100.0, "{:.0f}"),
)
# One colour per era (``docs/design.md``): the contiguous slabs, paged blocks, prefix reuse.
COLORS = {"contiguous": "#b0b0b0", "paged": "#4c72b0", "prefix": "#55a868"}


def plot_eras(result: dict[str, Any], path: Path, title: str | None = None) -> bool:
    """Draw one workload's eras (``result`` as stored by eras.py) to ``path``.

    Returns False, after a one-line note, when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed; skipping the plot", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eras = [e for e in result["eras"] if "error" not in e]
    if not eras:
        return False
    names = [e["era"] for e in eras]
    colors = [COLORS.get(n.split("-")[0], "#dd8452") for n in names]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, label, scale, fmt) in zip(axes.flat, PANELS, strict=True):
        values = [e["median"][key] * scale for e in eras]
        bars = ax.bar(range(len(names)), values, color=colors)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=8, padding=2)
        ax.set_title(label, fontsize=10)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    heading = title or result["workload"]
    fig.suptitle("\n".join(textwrap.wrap(f"KV-cache eras — {heading}", 110)), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    """Redraw the PNGs of a result file (one per workload, next to it unless --out-dir)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("results", type=Path, help="a JSON file written by benchmarks/eras.py")
    p.add_argument("--out-dir", type=Path, default=None, help="folder of the PNGs")
    args = p.parse_args(argv)
    doc = json.loads(args.results.read_text())
    for res in doc["results"]:
        path = (args.out_dir or args.results.parent) / f"eras-{res['workload']}.png"
        if plot_eras(res, path):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
