"""The report of ``serve.py``: the result file (run keys, order, saving), the markdown
table, the HTTP-overhead line, and the latency figure (the docs'
tables are rendered by ``benchmarks/docs_tables.py``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench_common import log, render_docs, write_json
from serve_servers import MAX_NUM_SEQS


def rate_key(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def rate_order(rate: float | str) -> float:
    return math.inf if rate == "inf" else float(rate)


def find_run(doc: dict[str, Any], *key: Any) -> dict | None:
    """The run of key ``(server, workload, rate, num_prompts, max_tokens)``, if any."""
    for e in doc.get("runs", []):
        if run_key(e) == key:
            return e
    return None


def run_key(e: dict[str, Any]) -> tuple[Any, ...]:
    return e["server"], e["workload"], e["request_rate"], e["num_prompts"], e["max_tokens"]


def markdown_table(doc: dict[str, Any]) -> str:
    """The runs as a markdown table (latencies in ms)."""
    head = (
        "server", "workload", "rate (req/s)", "requests ok × tokens", "TTFT p50", "TTFT p99",
        "TPOT mean", "TPOT p99", "ITL p99", "E2EL p50", "output tok/s", "req/s", "hit rate",
        "others' load",
    )  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    for e in doc["runs"]:
        rate = e["request_rate"]
        rate = f"inf (≤ {e['max_concurrency']} in flight)" if rate == "inf" else f"{rate:g}"
        hit = "–" if e["cache_hit_rate"] is None else f"{e['cache_hit_rate']:.2f}"
        cells = (
            f"{e['server']} {e.get('server_version') or ''}".strip(), e["workload"], rate,
            f"{e['completed']}/{e['num_prompts']} × {e['max_tokens']}",
            f"{e['median_ttft_ms']:.0f}", f"{e['p99_ttft_ms']:.0f}", f"{e['mean_tpot_ms']:.1f}",
            f"{e['p99_tpot_ms']:.1f}", f"{e['p99_itl_ms']:.1f}", f"{e['median_e2el_ms']:.0f}",
            f"{e['output_throughput']:.1f}", f"{e['request_throughput']:.2f}", hit,
            f"{e['load']['other_cores']:.2f}",
        )  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def overhead_line(doc: dict[str, Any]) -> str:
    o = doc.get("http_overhead")
    if not o:
        return "HTTP overhead: not measured (needs the offline run and kvstack shared-prefix/inf)."
    same = (
        f"; same greedy text {o['same_text_as_offline']}/{o['compared']}" if "compared" in o else ""
    )
    return (
        f"HTTP overhead (shared-prefix, {o.get('num_prompts')} requests × {o.get('max_tokens')} "
        f"tokens, rate inf): server {o['server_output_tok_s']:.1f} vs offline "
        f"{o['offline_output_tok_s']:.1f} output tok/s = **{o['ratio']:.2f}×** "
        f"({'meets' if o['pass'] else 'FAILS'} ≥ {o['required']}){same}."
    )


def plot(doc: dict[str, Any], path: Path) -> bool:
    """One row per workload: TTFT and TPOT against the request rate, a line per server
    (p50/mean solid, p99 dashed)."""
    try:
        import matplotlib
    except ImportError:
        log("note: matplotlib is not installed; no figure")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    runs = doc["runs"]
    rates = sorted({e["request_rate"] for e in runs}, key=rate_order)
    workloads = [w for w in doc["settings"]["workloads"] if any(e["workload"] == w for e in runs)]
    servers = sorted({e["server"] for e in runs}, key=lambda s: (s != "kvstack", s))
    if not runs or not workloads:
        return False
    panels = (("TTFT", "median_ttft_ms", "p50"), ("TPOT", "mean_tpot_ms", "mean"))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    ms = FuncFormatter(lambda v, _: f"{v:g}")
    for row, workload in zip(axes, workloads, strict=True):
        for ax, (metric, key, stat) in zip(row, panels, strict=True):
            for i, server in enumerate(servers):
                pts = sorted(
                    (rates.index(e["request_rate"]), e)
                    for e in runs
                    if (e["server"], e["workload"]) == (server, workload)
                )  # fmt: skip
                xs = [x for x, _ in pts]
                p99 = f"p99_{metric.lower()}_ms"
                ax.plot(xs, [e[key] for _, e in pts], "o-", color=f"C{i}", label=f"{server} {stat}")
                ax.plot(xs, [e[p99] for _, e in pts], "x--", color=f"C{i}", label=f"{server} p99")
            ax.set_xticks(range(len(rates)), [f"{r:g}" if r != "inf" else "inf" for r in rates])
            ax.set_xlabel("request rate (req/s; inf: all at once, ≤ 16 in flight)", fontsize=8)
            ax.set_ylabel(f"{metric} (ms)")
            ax.set_title(f"{workload}: {metric}", fontsize=10)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ms)
            ax.yaxis.set_minor_formatter(ms)
            ax.tick_params(axis="y", which="both", labelsize=7)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    s = doc["settings"]
    fig.suptitle(
        f"kvstack bench serve: {s['max_tokens']} new tokens, max_num_seqs {MAX_NUM_SEQS}, "
        f"greedy, {doc['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def sort_runs(doc: dict[str, Any]) -> None:
    """Runs by workload, then kvstack before peers, then rate."""
    names = doc["settings"]["workloads"]
    doc["runs"].sort(key=lambda e: (
        names.index(e["workload"]) if e["workload"] in names else len(names), e["workload"],
        e["server"] != "kvstack", e["server"], rate_order(e["request_rate"]),
    ))  # fmt: skip


def save(doc: dict[str, Any], out: Path) -> None:
    """Write the result file (without the requests and the generated texts)."""
    sort_runs(doc)
    clean = {k: v for k, v in doc.items() if not k.startswith("_")}
    clean["runs"] = [{k: v for k, v in e.items() if k != "generated_texts"} for e in doc["runs"]]
    for e, full in zip(clean["runs"], doc["runs"], strict=True):
        e["sample_generated_texts"] = full.get("generated_texts", [])[:2] or full.get(
            "sample_generated_texts", []
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(clean, out)
    log(f"wrote {out}")


def report(doc: dict[str, Any], png: Path, readme: bool) -> None:
    if not doc.get("runs"):
        raise SystemExit("no runs to report")
    sort_runs(doc)
    print(markdown_table(doc))
    print()
    print(overhead_line(doc))
    drawn = plot(doc, png)
    if drawn:
        log(f"wrote {png}")
    if readme:
        render_docs()
