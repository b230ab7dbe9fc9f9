"""Prefill/decode split on this CPU machine: does it pay?

Method. Two set-ups of two `kvstack serve` replicas behind `kvstack router`, each replica
a child process with one torch thread (``OMP_NUM_THREADS=1``: the machine has 2 cores),
bf16, ``--max-num-seqs 8``, sharing one local Redis as the KV tier:

* ``split``: one ``--role prefill`` and one ``--role decode`` replica. The router sends
  each request to the prefill replica with ``max_tokens 1``, waits until its blocks are
  in Redis, then sends the request to the decode replica, which loads them.
* ``colocated``: two ordinary replicas (``--role both``) behind the same router with the
  ``least_load`` policy; each prefills and decodes its own requests.

``kvstack bench serve`` sends the ``random`` workload (long prompts of ``--prompt-len``
tokens, all distinct, so no prefix reuse helps either set-up), ``max_tokens`` 64,
``ignore_eos``, at a Poisson rate, with ``--repeats`` seeds. Reported: medians of output
tok/s, TTFT p50/p99, ITL p50/p99 (the decode's smoothness: the point of a split is that
a long prefill never stalls running decodes) and E2E p50, and split / colocated ratios.

Output: ``benchmarks/results/pd-split-<date>.json``, a table on stdout; ``--write-readme`` then
re-renders the docs' measured tables from the results (``benchmarks/docs_tables.py``).

    .venv/bin/python benchmarks/pd_split.py --write-readme
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench_common import REPO_ROOT, RESULTS_DIR, log, median, render_docs, write_json
from bench_procs import ChildServer, bench_serve
from kvstack.testing.redis_server import LocalRedis

KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
KEYS += ("median_e2el_ms",)


def bench(url: str, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    args = ["--workload", "random", "--num-prompts", str(a.num_prompts)]
    args += ["--set", f"prompt_len={a.prompt_len}", "--max-tokens", "64"]
    res = bench_serve(url, [*args, "--request-rate", str(a.rate), "--seed", str(seed)])
    return {k: res[k] for k in (*KEYS, "completed", "failed", "cache_hit_rate")}


def run_setup(name: str, a: argparse.Namespace, redis: LocalRedis, logs: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["serve", "--max-num-seqs", "8", "--max-model-len", "4096"]
    common += ["--kv-offload", redis.url]
    roles = ("prefill", "decode") if name == "split" else ("both", "both")
    runs = []
    with ExitStack() as stack:
        reps = [
            stack.enter_context(
                ChildServer([*common, "--role", r], logs / f"pd-{name}-{i}.log", env)
            )
            for i, r in enumerate(roles)
        ]
        router_args = ["router", "--policy", "least_load"]
        for r in reps:
            router_args += ["--backend", r.url]
        router = stack.enter_context(ChildServer(router_args, logs / f"pd-{name}-router.log", env))
        time.sleep(3)  # the router's first /load poll has learned the roles
        for seed in range(a.repeats):
            r = bench(router.url, seed, a)
            log(f"[pd] {name} seed {seed}: {r['output_throughput']:.0f} tok/s, TTFT p50 "
                f"{r['median_ttft_ms']:.0f} ms, ITL p99 {r['p99_itl_ms']:.0f} ms")  # fmt: skip
            runs.append(r)
    return runs


def markdown(doc: dict[str, Any]) -> str:
    s, c = doc["summary"]["split"], doc["summary"]["colocated"]
    rows = [
        ("output tok/s", "output_throughput"), ("TTFT p50 ms", "median_ttft_ms"),
        ("TTFT p99 ms", "p99_ttft_ms"), ("ITL p50 ms", "median_itl_ms"),
        ("ITL p99 ms", "p99_itl_ms"), ("E2E p50 ms", "median_e2el_ms"),
    ]  # fmt: skip
    lines = ["| | colocated (2 × both) | split (prefill + decode) | split / colocated |"]
    lines.append("|---|---:|---:|---:|")
    for label, k in rows:
        ratio = s[k] / c[k] if c[k] else float("nan")
        lines.append(f"| {label} | {c[k]:.1f} | {s[k]:.1f} | {ratio:.2f}× |")
    lines.append(
        f"\n{doc['num_prompts']} distinct {doc['prompt_len']}-token prompts at "
        f"{doc['rate']} req/s, 64 output tokens, one torch thread per replica, medians of "
        f"{doc['repeats']} seeds. Measured {doc['date']}; `benchmarks/pd_split.py`."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=24, help="requests per run (default 24)")
    p.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens (default 1000)")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="seeds per set-up (default 3)")
    p.add_argument("--out", default=None, help="JSON path (default results/pd-split-DATE.json)")
    p.add_argument("--write-readme", action="store_true", help="then re-render the docs' tables")
    a = p.parse_args(argv)
    logs = REPO_ROOT / ".bench-venvs" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    with LocalRedis() as redis:
        for name in ("colocated", "split"):
            runs[name] = run_setup(name, a, redis, logs)
    date = dt.date.today().isoformat()
    doc = {
        "benchmark": "pd_split", "date": date, "num_prompts": a.num_prompts,
        "prompt_len": a.prompt_len, "rate": a.rate, "repeats": a.repeats, "runs": runs,
        "summary": {n: {k: median([r[k] for r in rs]) for k in KEYS} for n, rs in runs.items()},
    }  # fmt: skip
    write_json(doc, Path(a.out) if a.out else RESULTS_DIR / f"pd-split-{date}.json")
    table = markdown(doc)
    print(table)
    if a.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
