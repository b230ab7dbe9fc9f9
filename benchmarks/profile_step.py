"""Where a decode step's time goes: torch.profiler on kvstack at batch 32, bf16.

Python overhead = wall time of ``LLMEngine.step()`` minus the time spent inside aten /
extension ops (the sum of the profiler's self CPU times). Runs the benchmark workload's
prompts (200 tokens each), prefills them, then profiles ``--steps`` pure decode steps.

    .venv/bin/python benchmarks/profile_step.py --batch 32 --steps 10

Writes ``benchmarks/results/profile_step-<date>.json`` and prints the top ops.
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

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="decoding requests per step")
    ap.add_argument("--steps", type=int, default=10, help="decode steps to profile")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--top", type=int, default=12, help="ops to list")
    args = ap.parse_args()

    from workload import build_prompts  # benchmarks/workload.py

    llm = LLM("default", dtype=args.dtype, max_num_seqs=args.batch, kv_cache_memory="1GiB")
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
    eng.abort_request([f"p{i}" for i in range(args.batch)])

    events = prof.key_averages()
    op_self_s = sum(e.self_cpu_time_total for e in events) / 1e6
    wall_s = sum(walls)
    # Steps outside the profiler for a clean wall-time median.
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", None, sp, prompt_token_ids=p)
    clean: list[float] = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running):
            clean.append(time.perf_counter() - t0)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    result = {
        "benchmark": "profile_step",
        "date": dt.date.today().isoformat(),
        "batch": args.batch,
        "dtype": args.dtype,
        "profiled_steps": args.steps,
        "profiled_wall_ms_per_step": 1000 * wall_s / args.steps,
        "op_time_ms_per_step": 1000 * op_self_s / args.steps,
        "python_overhead_fraction": max(0.0, 1 - op_self_s / wall_s),
        "decode_step_ms_median_unprofiled": 1000 * statistics.median(clean[2:] or clean),
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
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
