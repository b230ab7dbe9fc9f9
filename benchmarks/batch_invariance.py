"""What bf16 batch invariance buys and costs: kvstack's linear routing before and after
2026-12-05, in one process (``model/kernels/packed_linear.py``: "Batch invariance").

- ``split``: the old rule on AVX512-BF16 CPUs: inputs of up to 64 rows (192 for layers no
  wider than ``WIDE_OUT``) to ``bf16_linear``, longer ones to oneDNN;
- ``every``: today's rule: ``bf16_linear`` takes every bf16 input.

Buys: each of ``--prompts`` chat prompts is generated greedily alone and again beside a long
batch mate (a ``--mate-tokens`` prompt in the same prefill step); the benchmark counts the
requests whose text or logprobs differ. Costs: offline throughput of ``--batch`` random
prompts of ``--input-len`` tokens -> ``--output-len``, both rules interleaved run by run
(medians of ``--runs``, ratio every / split). Prints the CPU model and ISA flags; JSON to
``benchmarks/results/batch_invariance-<date><tag>.json``. Only on a CPU whose kernel is
``avx512_bf16`` (elsewhere the old rule is today's, nothing to compare).

    PYTHONPATH=src python benchmarks/batch_invariance.py [--runs 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import torch

from bench_common import RESULTS_DIR, log, write_json
from kvstack import LLM, SamplingParams
from kvstack.model.kernels import packed_linear
from offline_throughput import machine_info

PROMPTS = [
    "Write a poem about the sea and the sky and the long night that",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):",
    "List three uses of a paperclip:",
    "The capital of Peru is",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Once upon a time in a land far away, there lived a",
    "What is 17 times 23? Think step by step.",
]


def split_rule(x: torch.Tensor, out_features: int) -> bool:
    """The routing of ``avx512_bf16`` until 2026-12-05."""
    rows = x.shape[0]
    small = rows <= 64 or (rows <= 192 and out_features <= packed_linear.WIDE_OUT)
    return packed_linear.use_every(x, out_features) and small


RULES = {"split": split_rule, "every": packed_linear.use_every}


def route(rule: str) -> None:
    kern = packed_linear.tile_kernel()
    assert kern is not None
    object.__setattr__(kern, "use", RULES[rule])  # (frozen: one kernel per process)


def divergence(llm: LLM, mate: list[int], max_tokens: int) -> dict[str, Any]:
    """Requests whose greedy text / logprobs change when the long mate shares their step."""
    tok = llm.tokenizer
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    texts, worst = 0, 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        alone = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)
        both = llm.generate(prompt_token_ids=[mate, ids], sampling_params=sp, use_tqdm=False)
        a, b = alone[0].outputs[0], both[1].outputs[0]
        texts += a.token_ids != b.token_ids
        for t, u, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            if t != u:  # (after the first different token the contexts differ)
                break
            worst = max(worst, abs(la[t].logprob - lb[t].logprob))
    return {"texts_changed": texts, "prompts": len(PROMPTS), "max_logprob_diff": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="throughput runs per rule (medians)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mate-tokens", type=int, default=400, help="the long batch mate's length")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    args = ap.parse_args()
    info = machine_info()
    log(f"CPU: {info.get('cpu_model')} flags {' '.join(info.get('cpu_flags', []))}")
    kern = packed_linear.tile_kernel()
    if kern is None or kern.name != "avx512_bf16":
        raise SystemExit(f"needs the avx512_bf16 kernel; this CPU runs {kern and kern.name}")
    llm = LLM("default", dtype="bfloat16", prefix_cache="none")
    rng = random.Random(0)
    mate = [rng.randrange(100, 40000) for _ in range(args.mate_tokens)]
    out: dict[str, Any] = {"machine": info, "args": vars(args), "rules": {}}
    for rule in RULES:
        route(rule)
        out["rules"][rule] = divergence(llm, mate, args.answer_tokens)
        log(f"{rule}: {out['rules'][rule]}")
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)]
               for _ in range(args.batch)]  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    times: dict[str, list[float]] = {r: [] for r in RULES}
    for run in range(args.runs):
        for rule in RULES if run % 2 == 0 else reversed(RULES):
            route(rule)
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
            times[rule].append(time.perf_counter() - t0)
            log(f"run {run} {rule}: {times[rule][-1]:.2f} s")
    tokens = args.batch * args.output_len
    for rule, ts in times.items():
        out["rules"][rule] |= {"runs_s": ts, "output_tok_s": tokens / statistics.median(ts)}
    ratio = out["rules"]["every"]["output_tok_s"] / out["rules"]["split"]["output_tok_s"]
    out["throughput_every_over_split"] = ratio
    for rule, row in out["rules"].items():
        print(f"{rule:6s} texts changed by a batch mate {row['texts_changed']}/{row['prompts']}"
              f", max |logprob diff| {row['max_logprob_diff']:.4f}, "
              f"{row['output_tok_s']:.1f} output tok/s")  # fmt: skip
    print(f"throughput every / split: {ratio:.3f}x")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    write_json(out, RESULTS_DIR / f"batch_invariance-{stamp}{args.tag}.json")


if __name__ == "__main__":
    main()
