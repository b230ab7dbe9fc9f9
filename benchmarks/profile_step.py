"""Where a decode step's time goes (torch.profiler, batch 32, bf16), and how far decode and
prefill steps are from their bounds on this machine (``benchmarks/roofline.py``).

Python overhead = wall time of ``LLMEngine.step()`` minus the time spent inside aten /
extension ops (the sum of the profiler's self CPU times; kvstack's C++ kernels are
``torch.ops.kvstack`` ops, so they count as ops). Runs the benchmark workload's prompts
(200 tokens each), prefills them, then profiles ``--steps`` pure decode steps. Then times
prefill steps of ``--prefill-prompts`` whole prompts (2,000 tokens by default) and
measures the bounds: decode max(bytes ÷ bandwidth, FLOPs ÷ GEMM throughput at M = batch),
prefill FLOPs ÷ GEMM throughput at M = 2048. The step times and the bounds are measured
side by side in ``--rounds`` rounds (the machine's bandwidth and GEMM rate drift by 20 %
and more between minutes on a shared VM), and the round with the median ratio is reported.

    .venv/bin/python benchmarks/profile_step.py --batch 32 --steps 10

Writes ``benchmarks/results/profile_step-<date>.json`` (CPU model and ISA flags included)
and prints the top ops and the step-vs-bound table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from kvstack import LLM, SamplingParams
from offline_throughput import machine_info
from roofline import decode_bound, prefill_bound

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="decoding requests per step")
    ap.add_argument("--steps", type=int, default=10, help="decode steps to profile")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--top", type=int, default=12, help="ops to list")
    ap.add_argument(
        "--prefill-prompts", type=int, default=10, help="200-token prompts per timed prefill step"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of (decode steps timed, prefill timed, bounds measured); the ratios "
        "are per round (the machine drifts between minutes) and their median is reported",
    )
    args = ap.parse_args()
    if args.rounds < 1 or args.batch < 1 or args.steps < 1:
        ap.error("--rounds, --batch and --steps must be at least 1")

    from workload import build_prompts  # benchmarks/workload.py

    # No prefix cache: the prompts share 144 tokens, and with a cache the timed "2,000-token"
    # prefill step took 581 ms where 2,000 tokens take >= 1 s on that CPU (the prompts'
    # shared blocks were reused), so it read as a prefill twice as fast as its bound.
    llm = LLM(
        "default",
        dtype=args.dtype,
        max_num_seqs=args.batch,
        kv_cache_memory="1GiB",
        prefix_cache="none",
    )
    eng = llm.engine
    prompts = build_prompts(args.batch)
    sp = SamplingParams(temperature=0, max_tokens=args.steps * 3 + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", None, sp, prompt_token_ids=p)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.running) or (
        eng.scheduler.waiting
    ):
        eng.step()
    for _ in range(args.steps):  # warm decode steps (kernel build, allocator)
        eng.step()

    walls: list[float] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t0)
    ctx_lens = [r.num_computed_tokens for r in eng.scheduler.running]
    eng.abort_request([f"p{i}" for i in range(args.batch)])

    events = prof.key_averages()
    op_self_s = sum(e.self_cpu_time_total for e in events) / 1e6
    wall_s = sum(walls)
    pre_lens = [len(p) for p in prompts[: args.prefill_prompts]]
    rounds = measure_rounds(llm, prompts, sp, args, ctx_lens)
    mid = sorted(rounds, key=lambda r: r["decode_over_bound"])[len(rounds) // 2]
    pre_mid = sorted(rounds, key=lambda r: r["prefill_over_bound"])[len(rounds) // 2]
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    result = {
        "benchmark": "profile_step",
        "date": dt.date.today().isoformat(),
        "machine": machine_info(),
        "batch": args.batch,
        "dtype": args.dtype,
        "profiled_steps": args.steps,
        "profiled_wall_ms_per_step": 1000 * wall_s / args.steps,
        "op_time_ms_per_step": 1000 * op_self_s / args.steps,
        "python_overhead_fraction": max(0.0, 1 - op_self_s / wall_s),
        # the round with the median ratio (its step time, bound and ratio), then all rounds
        "decode_step_ms_median_unprofiled": mid["decode_step_ms"],
        "decode_bound": mid["decode_bound"],
        "decode_over_bound": mid["decode_over_bound"],
        "prefill_tokens": sum(pre_lens),
        "prefill_step_ms_median": pre_mid["prefill_step_ms"],
        "prefill_bound": pre_mid["prefill_bound"],
        "prefill_over_bound": pre_mid["prefill_over_bound"],
        "rounds": rounds,
        "top_ops": [
            {
                "name": e.key,
                "self_ms_per_step": e.self_cpu_time_total / 1000 / args.steps,
                "calls_per_step": e.count / args.steps,
            }
            for e in top
        ],
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"profile_step-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "top_ops"}, indent=1))
    for op in result["top_ops"]:
        print(f"  {op['self_ms_per_step']:8.2f} ms  {op['calls_per_step']:6.0f}x  {op['name']}")
    print(bound_table(result))
    print(f"wrote {out}")


def measure_rounds(
    llm: LLM,
    prompts: list[list[int]],
    sp: SamplingParams,
    args: argparse.Namespace,
    ctx_lens: list[int],
) -> list[dict]:
    """``args.rounds`` rounds of (decode step timed, prefill timed, bounds measured)."""
    model = llm.engine.runner.model
    pre_lens = [len(p) for p in prompts[: args.prefill_prompts]]
    rounds = []
    for k in range(args.rounds):  # step times and the bounds measured side by side
        decode_ms = time_decode(llm, prompts, sp, args.batch, f"q{k}")
        prefill_ms = time_prefill(llm, prompts[: args.prefill_prompts])
        dec_bound = decode_bound(model, ctx_lens)
        pre_bound = prefill_bound(model, pre_lens)
        rounds.append(
            {
                "decode_step_ms": decode_ms,
                "decode_bound": dec_bound.to_dict(),
                "decode_over_bound": decode_ms / dec_bound.ms,
                "prefill_step_ms": prefill_ms,
                "prefill_bound": pre_bound.to_dict(),
                "prefill_over_bound": prefill_ms / pre_bound.ms,
            }
        )
        print(
            f"round {k + 1}: decode {decode_ms:.1f} ms ({rounds[-1]['decode_over_bound']:.2f}x"
            f" bound), prefill {prefill_ms:.0f} ms ({rounds[-1]['prefill_over_bound']:.2f}x)"
        )
    return rounds


def time_decode(
    llm: LLM, prompts: list[list[int]], sp: SamplingParams, batch: int, tag: str
) -> float:
    """Median ms of the steps that decode the whole batch (every request past its prompt,
    none waiting), outside the profiler. Before 2026-12-04 the filter looked at the running
    requests alone, so the step that admitted and prefilled the last waiting prompt and the
    batch's shrinking tail counted as decode steps."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", None, sp, prompt_token_ids=p)
    clean: list[float] = []
    while eng.has_unfinished_requests():
        running = eng.scheduler.running
        full = len(running) == batch and not eng.scheduler.waiting
        full = full and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        t0 = time.perf_counter()
        eng.step()
        if full:
            clean.append(time.perf_counter() - t0)
    return 1000 * statistics.median(clean[2:] or clean)


def time_prefill(llm: LLM, prompts: list[list[int]], runs: int = 3) -> float:
    """Median ms of one step that prefills all ``prompts`` (whole, no prefix cache hits)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for rep in range(runs + 1):  # the first is a warm-up
        for i, p in enumerate(prompts):
            eng.add_request(f"f{rep}-{i}", None, sp, prompt_token_ids=p)
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
        while eng.has_unfinished_requests():
            eng.step()
        eng.reset_prefix_cache()
    return 1000 * statistics.median(times[1:])


def bound_table(r: dict) -> str:
    m = r["machine"]
    db, pb = r["decode_bound"], r["prefill_bound"]
    rows = [
        f"CPU {m.get('cpu_model')} ({', '.join(m.get('cpu_flags', []))}), commit "
        f"{m.get('git_commit')}",
        "| step | measured ms | bound ms | memory bound | compute bound | measured / bound |",
        "|---|---:|---:|---|---|---:|",
        f"| decode, batch {r['batch']} | {r['decode_step_ms_median_unprofiled']:.1f} | "
        f"{db['bound_ms']:.1f} | {db['bytes_read'] / 2**20:.0f} MiB ÷ "
        f"{db['bandwidth_gib_s']:.1f} GiB/s = {db['memory_ms']:.1f} ms | {db['flops'] / 1e9:.1f}"
        f" GFLOP ÷ {db['gemm_gflops']:.0f} GFLOP/s = {db['compute_ms']:.1f} ms | "
        f"{r['decode_over_bound']:.2f}×{_per_round(r, 'decode_over_bound')} |",
        f"| prefill, {r['prefill_tokens']} tokens | {r['prefill_step_ms_median']:.0f} | "
        f"{pb['bound_ms']:.0f} | – | {pb['flops'] / 1e9:.0f} GFLOP ÷ {pb['gemm_gflops']:.0f} "
        f"GFLOP/s (M = 2048) | {r['prefill_over_bound']:.2f}×"
        f"{_per_round(r, 'prefill_over_bound')} |",
    ]
    return "\n".join(rows)


def _per_round(r: dict, key: str) -> str:
    """`` (rounds a, b, c)`` when the result has rounds (files before 2026-12-04 do not)."""
    rounds = r.get("rounds") or []
    return f" (rounds {', '.join(f'{x[key]:.2f}' for x in rounds)})" if len(rounds) > 1 else ""


if __name__ == "__main__":
    main()
