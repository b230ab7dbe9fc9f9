"""KV-aware routing on Ray Serve: ``kv_events`` / ``prefix`` against ``round_robin``.

Method. For each policy the script starts ``kvstack serve --ray --replicas 2
--replica-cpus 0.9 --policy P --num-blocks 384`` (a local Ray instance, 2 engine replicas
with one torch thread each, bf16, ``--max-num-seqs 8``, 384 KV blocks = 6,144 tokens per
replica) on a free loopback port and waits for ``/health``. Against it, ``kvstack bench
serve`` (the project's serving client, run as a child process with ``--save-result``)
sends two workloads from :mod:`kvstack.tools.workloads`, each with ``--repeats`` seeds
(new prompts every time, so an earlier run's cache does not help):

* ``multi-turn``: 15 conversations × 5 turns (75 requests) after one 400-token system
  prompt, 60-token user turns and 80-token assistant turns; turn k is sent after turn
  k-1 finished. At the last round the 15 histories need ~550 blocks: more than one
  replica holds, about what two hold when each keeps its own conversations.
* ``shared-prefix``: 63 requests of 1,100 tokens in 7 groups sharing a 1,000-token
  prefix (a long system prompt or document per group), arriving round-robin over the
  groups: the 7 prefixes need 441 blocks, ~250 per replica if each keeps its own groups.

That is the regime a router is for: the replicas' caches together hold the working set,
one alone does not. With caches larger than the working set, round-robin loses only the
prefix each replica must compute once (measured: 67.6 % vs 67.6 % hit rate on 32
shared-prefix requests, 75.9 % vs 76.7 % on 20 multi-turn ones). All requests go at
once with at most 8 in flight, ``max_tokens`` 32, greedy, ``ignore_eos``.

Reported per (policy, workload), medians over the seeds:
* hit rate: cached prompt tokens / prompt tokens, from the replies' ``usage`` (the same
  number each replica counts);
* output tok/s and request/s of the bench client, and TTFT p50;
* load balance: requests each replica got (the router's ``/router/state`` counts before
  and after the run) as max / mean over the 2 replicas (target ≤ 1.5), and the same for
  the prompt tokens each replica actually computed (its ``/metrics`` deltas);
* ratios of ``prefix`` and ``kv_events`` to ``round_robin`` in the same run of the script.

Output: ``benchmarks/results/routing-<date>.json``, a markdown table on stdout;
``--write-readme`` then re-renders the docs' measured tables from the results
(``benchmarks/docs_tables.py``).

    .venv/bin/python benchmarks/routing.py --write-readme
    .venv/bin/python benchmarks/routing.py --quick   # 1 seed, smaller workloads
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import urllib.request
from pathlib import Path
from typing import Any

from bench_common import REPO_ROOT, RESULTS_DIR, log, median, render_docs, write_json
from bench_procs import ChildServer, bench_serve, get_json

POLICIES = ("round_robin", "prefix", "kv_events")
MULTI_TURN = ["--set", "system_len=400", "--set", "user_len=60", "--set", "assistant_len=80"]
SHARED = ["--set", "shared_prefix_len=1000", "--set", "prompt_len=1100", "--set", "num_groups=7"]
# Odd counts on purpose: the workloads arrive round-major (conversation c's turn k after
# every conversation's turn k-1; request i in group i % groups), so with an even count
# round-robin over 2 replicas would send each conversation or group to one replica by
# accident and look cache-aware.
WORKLOADS = {
    "multi-turn": ["--num-prompts", "75", *MULTI_TURN],
    "shared-prefix": ["--num-prompts", "63", *SHARED],
}
QUICK = {
    "multi-turn": ["--num-prompts", "35", *MULTI_TURN],
    "shared-prefix": ["--num-prompts", "35", *SHARED],
}
NUM_BLOCKS = 384


def replica_counters(url: str) -> dict[str, float]:
    """Prompt tokens the replica computed (its own /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {"computed": 0.0}
    for line in text.splitlines():
        if line.startswith("kvstack:prefill_tokens_computed_total"):
            out["computed"] += float(line.rsplit(" ", 1)[1])
    return out


class RayDeployment(ChildServer):
    """``kvstack serve --ray`` with 2 replicas and ``policy``, ready once both serve."""

    def __init__(self, policy: str, log_dir: Path) -> None:
        args = ["serve", "--ray", "--replicas", "2", "--replica-cpus", "0.9", "--policy"]
        args += [policy, "--max-num-seqs", "8", "--max-model-len", "4096"]
        args += ["--num-blocks", str(NUM_BLOCKS)]
        super().__init__(args, log_dir / f"routing-{policy}.log", timeout_s=300)
        self.policy = policy

    def ready(self) -> bool:
        return len(self.state()["replicas"]) == 2

    def state(self) -> dict[str, Any]:
        return dict(get_json(self.url + "/router/state")[0])


def snapshot(dep: RayDeployment) -> dict[str, dict[str, float]]:
    out = {}
    for r in dep.state()["replicas"]:
        out[r["id"]] = {"routed": float(r["routed"]), **replica_counters(r["url"])}
    return out


def imbalance(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def bench_run(dep: RayDeployment, workload: str, extra: list[str], seed: int) -> dict[str, Any]:
    before = snapshot(dep)
    args = ["--workload", workload, *extra, "--seed", str(seed), "--max-tokens", "32"]
    res = bench_serve(dep.url, [*args, "--max-concurrency", "8", "--label", dep.policy])
    after = snapshot(dep)
    routed = [after[k]["routed"] - before.get(k, {}).get("routed", 0.0) for k in after]
    computed = [after[k]["computed"] - before.get(k, {}).get("computed", 0.0) for k in after]
    return {
        "seed": seed,
        "completed": res["completed"],
        "failed": res["failed"],
        "hit_rate": res["cache_hit_rate"],
        "output_throughput": res["output_throughput"],
        "request_throughput": res["request_throughput"],
        "median_ttft_ms": res["median_ttft_ms"],
        "routed": routed,
        "computed_prompt_tokens": computed,
        "load_imbalance": imbalance(routed),
        "compute_imbalance": imbalance(computed),
        "reasons": dep.state()["reasons"],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("hit_rate", "output_throughput", "request_throughput", "median_ttft_ms")
    out = {k: median([r[k] for r in runs]) for k in keys}
    out["load_imbalance"] = max(r["load_imbalance"] for r in runs)  # worst seed
    out["compute_imbalance"] = max(r["compute_imbalance"] for r in runs)
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "| workload | policy | prefix hit rate | output tok/s | × round_robin | TTFT p50 ms "
        "| max/mean requests | max/mean prefill computed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for wl, by_policy in doc["summary"].items():
        base = by_policy.get("round_robin", {}).get("output_throughput")
        for pol, s in by_policy.items():
            ratio = f"{s['output_throughput'] / base:.2f}×" if base else "–"
            lines.append(
                f"| {wl} | {pol} | {s['hit_rate']:.1%} | {s['output_throughput']:.0f} | {ratio} "
                f"| {s['median_ttft_ms']:.0f} | {s['load_imbalance']:.2f} "
                f"| {s['compute_imbalance']:.2f} |"
            )
    lines.append(
        f"\n2 replicas on Ray Serve (one torch thread, {NUM_BLOCKS} KV blocks each), "
        "`kvstack bench serve`, medians of "
        f"{doc['repeats']} seeds (max/mean: the worst seed). Measured {doc['date']}; "
        "`benchmarks/routing.py`."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    p.add_argument("--repeats", type=int, default=3, help="seeds per workload (default 3)")
    p.add_argument("--quick", action="store_true", help="1 seed, half the requests")
    p.add_argument("--out", default=None, help="JSON path (default results/routing-DATE.json)")
    p.add_argument("--write-readme", action="store_true", help="then re-render the docs' tables")
    a = p.parse_args(argv)
    repeats = 1 if a.quick else a.repeats
    workloads = QUICK if a.quick else WORKLOADS
    date = dt.date.today().isoformat()
    log_dir = REPO_ROOT / ".bench-venvs" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in workloads}
    for policy in a.policies.split(","):
        log(f"[routing] starting 2 replicas with policy {policy}")
        with RayDeployment(policy, log_dir) as dep:
            for wl, extra in workloads.items():
                for seed in range(repeats):
                    r = bench_run(dep, wl, extra, seed)
                    log(
                        f"[routing] {policy} {wl} seed {seed}: hit {r['hit_rate']:.1%}, "
                        f"{r['output_throughput']:.0f} tok/s, routed {r['routed']}"
                    )
                    runs[wl].setdefault(policy, []).append(r)
    doc = {
        "benchmark": "routing",
        "date": date,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "summary": {wl: {p: summarize(rs) for p, rs in by.items()} for wl, by in runs.items()},
    }
    tag = "-quick" if a.quick else ""
    out = Path(a.out) if a.out else RESULTS_DIR / f"routing-{date}{tag}.json"
    write_json(doc, out)
    table = markdown(doc)
    print(table)
    if a.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
