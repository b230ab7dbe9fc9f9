"""Serving benchmark: ``kvstack serve`` (and vLLM's OpenAI server) under ``kvstack bench serve``.

Method. Workloads come from :mod:`kvstack.tools.workloads` (seed 0, kvstack's tokenizer):
``shared-prefix`` (32 requests of 200 prompt tokens, 144 shared) and ``multi-turn`` (40
requests = 8 conversations × 5 turns; turn k is sent only after turn k-1 of the same
conversation finished). Each server is started as a child process on a free 127.0.0.1 port
(``kvstack serve --max-num-seqs 16 --max-model-len 2048``; with ``--peers vllm``, vLLM's
``vllm.entrypoints.openai.api_server`` from ``.bench-venvs/vllm`` with the same limits,
prefix caching on, bf16 (``--peers vllm-fp32``: float32, vLLM's best setting on a CPU
without AVX512-BF16 / AMX) and the environment ``benchmarks/offline_throughput.py`` gives
vLLM), is
ready when ``GET /health`` answers 200, and is stopped with SIGTERM at the end (its log goes
to ``.bench-venvs/logs/serve-<server>.log``). Before the timed runs the script checks, with
``POST /tokenize``, that the server's chat template turns every request's ``messages`` into
exactly the workload's ``prompt_token_ids``, and sends a few short warm-up requests.

Each (workload, request rate) is one run of the in-process client
(:func:`kvstack.tools.bench.run_benchmark`: streaming chat completions, ``max_tokens`` 64,
``ignore_eos``, temperature 0, Poisson arrivals of the given rate, seed 0; rate ``inf``
sends everything at once with at most 16 requests in flight). Before every run the
server's prefix cache is emptied (``POST /reset_prefix_cache``; vLLM needs
``VLLM_SERVER_DEV_MODE=1`` for it, which is set) so the hit rate is the reuse within the
run, and the script waits for the machine to be idle. During the run it measures the cores
used by the server's processes, by this client, and by anything else (``others``); a run
during which others used more than 0.15 core is repeated once. Reported per run (vLLM's
definitions, :mod:`kvstack.tools.bench.report`): TTFT p50/p99, TPOT mean/p99, ITL p99,
E2EL p50 (ms), output tok/s, requests/s and the cached-token hit rate.

HTTP overhead. The offline engine (``LLM(max_num_seqs=16, max_model_len=2048)``, in its
own process, before any server starts) generates for the shared-prefix prompts'
``prompt_token_ids`` (identical to what the server prefills, see above) with the same
sampling, timed by ``bench_common.measure``: one warm-up of the batch, then one timed run,
the prefix cache emptied before each. Its output tok/s is compared with the server's
shared-prefix run at rate inf (≤ 16 in flight); the target is server / offline ≥ 0.8.
The server run also pays for the client (same 2 cores) and for HTTP/SSE; the greedy texts
of both are compared as a sanity check (bf16 batches of different shapes may flip a few).

Output: ``benchmarks/results/serve-<date>.json`` (``--out``; merged: a rerun replaces the
runs of the same server, workload and rate), a markdown table on stdout, the figure
``benchmarks/results/serve-latency.png`` (TTFT and TPOT against the request rate; next to
``--out`` as ``<stem>-latency.png`` with ``--out`` or ``--quick``) and
``--write-readme`` then re-renders the docs' measured tables from the results
(``benchmarks/docs_tables.py``).

Examples::

    .venv/bin/python benchmarks/serve.py --peers vllm --write-readme
    .venv/bin/python benchmarks/serve.py --quick --out /tmp/serve-quick.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench_common import (
    REPO_ROOT,
    RESULTS_DIR,
    cpu_busy_seconds,
    log,
    venv_python,
    wait_for_idle,
)
from offline_throughput import machine_info
from serve_offline import offline_worker, overhead, run_offline
from serve_report import find_run, rate_key, report, run_key, save
from serve_servers import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    Server,
    http,
    running,
    tree_cpu_seconds,
)

DEFAULT_PROMPTS = {"shared-prefix": 32, "multi-turn": 40}
INF_CONCURRENCY = 16
MAX_OTHER_LOAD = 0.15  # cores others may use during a run before it is repeated (once)
PERCENTILES = [50.0, 90.0, 99.0]

# --------------------------------------------------------------------------- runs


def reset_cache(base: str) -> bool:
    """Empty the server's prefix cache; False when the server does not allow it."""
    for _ in range(5):
        status, body = http("POST", f"{base}/reset_prefix_cache")
        if status == 200 and not (isinstance(body, dict) and body.get("success") is False):
            return True
        if status in (0, 404, 405):
            return False
        time.sleep(1.0)  # vLLM: blocks still held
    return False


def check_prompts(base: str, model: str, reqs: Sequence[Any]) -> dict[str, Any]:
    """How many requests' chat messages the server tokenizes to ``prompt_token_ids``."""
    same, first_diff = 0, None
    for r in reqs:
        body = {"model": model, "messages": r.messages, "add_generation_prompt": True}
        status, ans = http("POST", f"{base}/tokenize", body)
        tokens = ans.get("tokens") if isinstance(ans, dict) else None
        if tokens == r.prompt_token_ids:
            same += 1
        elif first_diff is None:
            first_diff = {
                "request_id": r.request_id,
                "status": status,
                "server_len": len(tokens) if isinstance(tokens, list) else None,
                "workload_len": len(r.prompt_token_ids),
            }
    return {"identical": same, "total": len(reqs), "first_difference": first_diff}


def bench_once(server: Server, reqs: Sequence[Any], rate: float) -> dict[str, Any]:
    """One timed run of ``reqs`` at ``rate``; the entry stored in the result file."""
    from kvstack.tools.bench import BenchConfig, run_benchmark
    from kvstack.tools.bench.report import calculate_metrics

    cfg = BenchConfig(
        base_url=server.base, request_rate=rate, seed=0, ignore_eos=True, temperature=0.0,
        max_concurrency=INF_CONCURRENCY if math.isinf(rate) else None,
    )  # fmt: skip
    cache_reset = reset_cache(server.base)
    busy0, own0, srv0, t0 = (
        cpu_busy_seconds(), time.process_time(), tree_cpu_seconds(server.proc.pid), time.time()
    )  # fmt: skip
    results, duration, model = asyncio.run(run_benchmark(reqs, cfg))
    wall = max(time.time() - t0, 1e-9)
    own = time.process_time() - own0
    srv = tree_cpu_seconds(server.proc.pid) - srv0
    others = max(cpu_busy_seconds() - busy0 - own - srv, 0.0) / wall
    metrics = calculate_metrics(results, duration, PERCENTILES).to_json()
    texts = metrics.pop("generated_texts")
    return {
        "server": server.name,
        "model_id": model,
        "request_rate": rate_key(rate),
        "max_concurrency": cfg.max_concurrency,
        "num_prompts": len(reqs),
        "max_tokens": reqs[0].max_tokens,
        "cache_reset": cache_reset,
        "load": {
            "server_cores": round(srv / wall, 2),
            "client_cores": round(own / wall, 2),
            "other_cores": round(others, 2),
        },
        "measured_at": dt.datetime.now().isoformat(timespec="seconds"),
        "prompt_tokens_as_workload": sum(
            r.prompt_tokens == r.prompt_len for r in results if r.success
        ),
        **metrics,
        "generated_texts": texts,  # dropped from the file after the offline comparison
    }


def bench_server(
    name: str, workloads: dict[str, list[Any]], rates: list[float], wait_idle: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every workload at every rate on server ``name``: ``(server info, run entries)``."""
    entries: list[dict[str, Any]] = []
    if wait_idle > 0:
        log(f"[{name}] waited {wait_for_idle(wait_idle):.0f} s for an idle machine")
    with running(name) as (server, info):
        from kvstack.tools.bench import BenchConfig, run_benchmark

        model = http("GET", f"{server.base}/v1/models")[1]["data"][0]["id"]
        info["prompt_check"] = {
            w: check_prompts(server.base, model, r) for w, r in workloads.items()
        }
        for w, check in info["prompt_check"].items():
            if check["identical"] != check["total"]:
                log(f"[{name}] WARNING: {w}: server prompts differ: {check}")
        warm = [replace(r, max_tokens=4) for r in next(iter(workloads.values()))[:4]]
        t0 = time.perf_counter()
        asyncio.run(run_benchmark(warm, BenchConfig(base_url=server.base, max_concurrency=4)))
        info["warmup_s"] = round(time.perf_counter() - t0, 2)
        for workload, reqs in workloads.items():
            for rate in rates:
                discarded: list[dict[str, Any]] = []
                while True:
                    if wait_idle > 0:
                        wait_for_idle(min(wait_idle, 30.0))
                    entry = bench_once(server, reqs, rate)
                    entry["workload"] = workload
                    log(f"[{name}] {summary(entry)}")
                    if entry["load"]["other_cores"] <= MAX_OTHER_LOAD or discarded:
                        break
                    log(f"[{name}] machine busy during the run: repeating it")
                    discarded.append({k: entry[k] for k in ("load", "output_throughput")})
                entry["discarded"] = discarded
                entries.append(entry)
    return info, entries


def summary(e: dict[str, Any]) -> str:
    return (
        f"{e['workload']} rate {e['request_rate']}: {e['completed']}/{e['num_prompts']} ok, "
        f"{e['output_throughput']:.1f} out tok/s, TTFT p50 {e['median_ttft_ms']:.0f} ms, TPOT "
        f"{e['mean_tpot_ms']:.1f} ms, hit rate {e['cache_hit_rate'] or 0:.2f}, load {e['load']}"
    )


# --------------------------------------------------------------------------- main


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 or inf: {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join((__doc__ or "").splitlines()[1:]),
    )
    p.add_argument(
        "--peers", default="",
        help="comma-separated peer servers: vllm (bf16, kvstack's dtype), vllm-fp32 (vLLM in "
        "float32: its best setting on CPUs without AVX512-BF16 / AMX)",
    )  # fmt: skip
    p.add_argument("--skip-kvstack", action="store_true", help="do not run kvstack's server")
    p.add_argument("--skip-offline", action="store_true", help="no offline (HTTP-overhead) run")
    p.add_argument("--rates", type=parse_rates, default=[1.0, 4.0, math.inf], help="1,4,inf")
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    p.add_argument(
        "--num-prompts", type=int, default=None,
        help="requests per workload (default: shared-prefix 32, multi-turn 40 = 8 × 5 turns)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="8 prompts, 8 tokens, rate inf, no peers")
    p.add_argument("--wait-idle", type=float, default=120.0, help="s to wait for an idle machine")
    p.add_argument("--out", type=Path, default=None, help="result file (default: dated)")
    p.add_argument("--write-readme", action="store_true", help="then re-render the docs' tables")
    p.add_argument("--report-only", action="store_true", help="only print/plot the result file")
    p.add_argument("--worker-offline", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return p


def git_dirty() -> bool | None:
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(out.strip())


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker_offline:
        offline_worker(args.worker_offline, args.worker_out)
        return
    if args.quick:
        args.num_prompts, args.max_tokens, args.rates, args.peers = 8, 8, [math.inf], ""
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := set(peers) - {"vllm", "vllm-fp32"}:
        raise SystemExit(f"unknown peers: {sorted(unknown)}")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    date = dt.date.today().isoformat()
    out = args.out or RESULTS_DIR / f"serve-{date}{'-quick' if args.quick else ''}.json"
    png = (
        out.with_name(f"{out.stem}-latency.png")
        if args.out or args.quick
        else RESULTS_DIR / "serve-latency.png"
    )
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if args.report_only:
        report(doc, png, args.write_readme)
        return

    from kvstack.model.loader.registry import load_tokenizer
    from kvstack.tools.workloads import make_workload, summarize

    tok = load_tokenizer("default")
    counts = {w: args.num_prompts or DEFAULT_PROMPTS.get(w, 32) for w in names}
    workloads = {
        w: make_workload(w, tok, counts[w], seed=0, max_tokens=args.max_tokens) for w in names
    }
    doc.update(
        benchmark="serve",
        date=date,
        file=out.name,
        command=[Path(sys.executable).name, *sys.argv],
        machine={**machine_info(), "git_dirty": git_dirty()},
        settings={
            "workloads": names, "num_prompts": counts, "max_tokens": args.max_tokens,
            "rates": [rate_key(r) for r in args.rates], "max_concurrency_at_inf": INF_CONCURRENCY,
            "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN, "seed": 0,
            "temperature": 0.0, "ignore_eos": True, "endpoint": "chat", "quick": args.quick,
            "percentiles": PERCENTILES, "cache": "emptied before every run",
        },
        workload_summary={w: summarize(r) for w, r in workloads.items()},
    )  # fmt: skip
    doc.setdefault("servers", {})
    doc.setdefault("runs", [])
    doc["_requests"] = workloads  # for the text comparison; not written

    if not args.skip_offline and "shared-prefix" in workloads:
        if args.wait_idle > 0:
            log(f"[offline] waited {wait_for_idle(args.wait_idle):.0f} s for an idle machine")
        doc["offline"] = run_offline(workloads["shared-prefix"])
    servers = ([] if args.skip_kvstack else ["kvstack"]) + peers
    for name in servers:
        if name.startswith("vllm") and not venv_python("vllm").exists():
            note = f"skipped: {venv_python('vllm')} missing (bash benchmarks/setup_peers.sh)"
            log(f"[{name}] {note}")
            doc["servers"][name] = {"note": note}
            continue
        try:
            info, entries = bench_server(name, workloads, args.rates, args.wait_idle)
        except RuntimeError as e:
            log(f"[{name}] FAILED: {e}")
            doc["servers"][name] = {"error": str(e)}
            continue
        doc["servers"][name] = info
        for e in entries:
            e["server_version"] = info.get("version")
            old = find_run(doc, *run_key(e))
            if old is not None:
                doc["runs"].remove(old)
            doc["runs"].append(e)
        save(doc, out)
    if not (args.skip_kvstack and args.skip_offline):  # else keep the earlier comparison
        doc["http_overhead"] = overhead(doc, tok) or doc.get("http_overhead")
    save(doc, out)
    report(doc, png, args.write_readme)


if __name__ == "__main__":
    main()
