"""Where one request's decode time goes: ms per token split into the model forward and
the rest (scheduler, runner inputs, sampler, output processing), for kvstack variants.

One request, the ``latency.py`` prompts (512 tokens), ``--new-tokens`` greedy tokens, EOS
ignored. Each engine stage is wrapped with a timer (``LLMEngine.step`` -> scheduler,
``ModelRunner.execute`` (inputs, ``LlamaModel.forward``, sampling), update and output
processing); ``--torch-profile`` adds a torch.profiler table of the decode steps (top ops
by self CPU time); ``--compare-team`` alternates runs with ``decode_team`` off (the step
as ``decode_stack``'s separate kernel calls) and prints the ratio. ``--clock thread
--threads 1`` measures CPU time instead of wall time (a loaded machine stalls OpenMP
barriers). Timings are medians over ``--runs`` runs;
the machine is shared, so other processes' CPU use during the runs is printed with them.

    cd benchmarks && PYTHONPATH=../src python profile_decode.py \
        --variant bf16: --variant gguf:quantization=gguf --clock thread --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from bench_common import LoadMeter
from latency import build_prompts, parse_variant

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
clock = time.perf_counter


def _wrap(obj: Any, name: str, bucket: str, acc: dict[str, float]) -> None:
    inner: Callable[..., Any] = getattr(obj, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t = clock()
        try:
            return inner(*a, **kw)
        finally:
            acc[bucket] += clock() - t

    setattr(obj, name, timed)


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over runs, and the time of the runner and the engine outside the model."""
    med: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    med["runner_other"] = round(med["execute"] - med["forward"] - med.get("sample", 0), 3)
    med["engine_other"] = round(med["total"] - med["execute"] - med["schedule"], 3)
    return med


def profile_variant(kwargs: dict[str, Any], prompt: list[int], args: argparse.Namespace) -> dict:
    import torch

    from kvstack import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(
        "default",
        **{"max_model_len": 1024, "prefix_cache": "none", "kv_cache_memory": "256MiB", **kwargs},
    )
    eng = llm.engine
    acc: dict[str, float] = defaultdict(float)
    _wrap(eng.scheduler, "schedule", "schedule", acc)
    _wrap(eng.scheduler, "update_from_output", "update", acc)
    _wrap(eng.runner, "execute", "execute", acc)
    _wrap(eng.model, "forward", "forward", acc)
    _wrap(eng.runner, "_sample", "sample", acc)
    _wrap(eng.outputs, "on_new_token", "outputs", acc)
    _wrap(eng.outputs, "outputs_for", "outputs", acc)

    def one(n: int) -> dict[str, float]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        eng.add_request(None, prompt, sp)
        eng.step()  # prefill + first token
        acc.clear()
        steps, tokens = 0, 1
        t0 = clock()
        while eng.has_unfinished_requests():
            outs = eng.step()
            steps += 1
            if outs:
                tokens = len(outs[0].outputs[0].token_ids)
        wall = clock() - t0
        per = {k: 1e3 * v / (tokens - 1) for k, v in acc.items()}
        per["total"] = 1e3 * wall / (tokens - 1)
        per["tokens_per_step"] = (tokens - 1) / steps
        return per

    from kvstack.model.arch import decode_stack

    one(16)  # warm-up
    teams = (True, False) if args.compare_team else (True,)
    runs: dict[bool, list[dict[str, float]]] = {t: [] for t in teams}
    with LoadMeter() as meter:
        for _ in range(args.runs):
            for team in teams:  # alternating: a drift of the machine hits both alike
                decode_stack.TEAM = team
                runs[team].append(one(args.new_tokens))
    decode_stack.TEAM = True
    med = summary(runs[True])
    if args.compare_team:
        med["stack_without_team"] = summary(runs[False])
        med["team_speedup"] = round(med["stack_without_team"]["total"] / med["total"], 3)
    med["others_cores"] = round(meter.other_cores, 2)
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        eng.add_request(None, prompt, sp)
        eng.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            while eng.has_unfinished_requests():
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=None, help="NAME:KEY=VALUE,...")
    ap.add_argument("--prompt", default="open", choices=["open", "repetitive"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument(
        "--compare-team",
        action="store_true",
        help="alternate each run with decode_team off (decode_stack's kernel calls) and "
        "print both and their ratio",
    )
    ap.add_argument(
        "--clock",
        default="wall",
        choices=sorted(CLOCKS),
        help="wall time, or the main thread's CPU time (with --threads 1: robust to a "
        "shared machine's load, which stalls OpenMP barriers)",
    )
    args = ap.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    prompt = build_prompts()[args.prompt]
    for name, kwargs in map(parse_variant, args.variant or ["bf16:"]):
        med = profile_variant(kwargs, prompt, args)
        print(name, json.dumps(med))


if __name__ == "__main__":
    main()
