"""Run ``kvstack analyze`` on a log of each synthetic workload; table and curves for the docs.

For each workload (``kvstack.tools.workloads``, seed 0) the script writes its JSONL log,
runs ``kvstack analyze LOG --format openai --model default`` at the same cache sizes for
every policy (LRU, LFU, adaptive, the Belady oracle), saves the JSON report and the PNG
curve under ``benchmarks/results/``, and prints a markdown table of the token hit rate
per policy at each size plus the knee. ``--write-readme`` then
re-renders the docs' measured tables from the results (``benchmarks/docs_tables.py``).

    .venv/bin/python benchmarks/analyze_workloads.py --write-readme
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_common import RESULTS_DIR, log, render_docs

WORKLOADS = {"multi-turn": 40, "rag-qa": 32, "agent-tools": 32, "few-shot": 32, "shared-prefix": 32}
SIZES = "2048,4096,8192,16384,32768"
POLICIES = ("lru", "lfu", "adaptive", "oracle")


def analyze(name: str, n: int, out_dir: Path) -> dict[str, Any]:
    logf = out_dir / f"analyze-{name}.jsonl"
    report = out_dir / f"analyze-{name}.json"
    png = out_dir / f"analyze-{name}.png"
    py = sys.executable
    subprocess.run(
        [py, "-m", "kvstack.tools.workloads", name, "--num-requests", str(n), "--out", str(logf)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    cmd = [py, "-m", "kvstack.cli", "analyze", str(logf), "--format", "openai", "--model",
           "default", "--cache-size", SIZES, "--policy", ",".join(POLICIES), "--quiet",
           "--output-json", str(report), "--plot", str(png)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    logf.unlink()  # the log is regenerated from the seed; keep only the report and plot
    return {"name": name, "report": json.loads(report.read_text()), "png": png}


def rate(report: dict[str, Any], policy: str, size: int) -> float | None:
    for r in report["results"]:
        if r["policy"] == policy and r["cache_size_tokens"] == size:
            return float(r["token_hit_rate"])
    return None


def table(results: list[dict[str, Any]]) -> str:
    sizes = [int(s) for s in SIZES.split(",")]
    head = (
        "| workload | ideal | policy | " + " | ".join(f"{s // 1024}K" for s in sizes) + " | knee |"
    )
    lines = [head, "|---|---:|---|" + "---:|" * len(sizes) + "---:|"]
    for res in results:
        rep = res["report"]
        for i, pol in enumerate(POLICIES):
            cells = []
            for s in sizes:
                v = rate(rep, pol, s)
                cells.append("–" if v is None else f"{100 * v:.1f}")
            knee = rep.get("knees", {}).get(pol)
            first = f"{res['name']} | {100 * rep['ideal_hit_rate']:.1f}" if i == 0 else " | "
            lines.append(f"| {first} | {pol} | " + " | ".join(cells) + f" | {knee} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--write-readme",
        action="store_true",
        help="then re-render the docs' measured tables (benchmarks/docs_tables.py)",
    )
    args = p.parse_args(argv)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    results = []
    for name, n in WORKLOADS.items():
        log(f"analyzing {name} ({n} requests)")
        results.append(analyze(name, n, RESULTS_DIR))
    md = table(results)
    print(md)
    if args.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
