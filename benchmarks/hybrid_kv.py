"""KV bytes a request holds with the hybrid KV manager vs one block table
(vLLM v1's hybrid manager for sliding-window models; ``docs/kv/hybrid.md``).

For each context length (``--contexts``, default 4,096 and 8,192 tokens of real English:
the Python Language Reference's prose, ``kvstack.tools.eval.corpus``), one request on the
model (``--model``, default ``gemma3-270m``: 15 sliding-window layers of 512 tokens, 3
global ones) generates ``--new-tokens`` greedily, once with the hybrid manager (one table
per KV group, ``kv/hybrid.py``) and once with ``--disable-hybrid-kv-cache-manager`` (one
table for all layers), ``--runs`` times each in turns. Reported per mode: KV bytes held
at the end of decoding and at the peak (prefill chunks included: pages held x page
bytes), TTFT and decode tok/s (medians), and whether the greedy tokens are equal. Next
to them the planner's per-request figure (``kvstack plan``'s ``make_plan`` on the same
shapes and block size: whole blocks, a window layer the blocks its next row can read).
Then the cost in time: ``--batch-prompts`` prompts shorter than the window through both
modes in turns (output tok/s, the ratio per run). ``--kv-press NAME --kv-press-ratio R``
presses every request (token eviction: the global layers only, ``kv/press/compact.py``), so the
bytes held show what a press saves on top of the windows.

Prints the CPU model and ISA flags; writes ``benchmarks/results/hybrid_kv-<date><tag>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import torch

from bench_common import RESULTS_DIR, log, write_json
from kvstack import LLM, SamplingParams
from kvstack.tools.eval.corpus import reference_manual_text
from kvstack.tools.plan.sizing import make_plan
from kvstack.tools.plan.specs import ModelSpec, resolve_gpu
from offline_throughput import machine_info


def prompt_ids(llm: LLM, n: int) -> list[int]:
    ids = llm.tokenizer.encode(reference_manual_text())
    assert len(ids) >= n, f"the corpus has {len(ids)} tokens, fewer than {n}"
    return ids[:n]


def one_run(llm: LLM, ids: list[int], new_tokens: int, press: dict[str, Any]) -> dict[str, Any]:
    """Generate for one request (``press``: its ``kv_press`` fields), stepping the engine;
    pages held after every step."""
    engine = llm.engine
    kv = engine.kv_manager
    page_bytes = engine.kv_storage.nbytes / len(kv.pool.blocks)  # type: ignore[attr-defined]
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, **press)
    engine.add_request("r", None, sp, prompt_token_ids=ids)
    t0 = time.perf_counter()
    peak = end = 0
    ttft: float | None = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        held = kv.num_blocks - kv.num_free_blocks
        peak = max(peak, held)
        if engine.has_unfinished_requests():
            end = held
        for o in outs:
            tokens = list(o.outputs[0].token_ids)
            if ttft is None and tokens:
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    assert ttft is not None
    llm.reset_prefix_cache()
    return {
        "ttft_s": ttft,
        "decode_tok_s": (len(tokens) - 1) / (total - ttft),
        "peak_bytes": peak * page_bytes,
        "end_bytes": end * page_bytes,
        "tokens": tokens,
    }


def batch_tok_s(
    llm: LLM, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    """Output tok/s of one ``generate`` over ``prompts`` (prefix cache emptied first)."""
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return len(prompts) * new_tokens / seconds, [list(o.outputs[0].token_ids) for o in outs]


def batch_row(llms: dict[str, LLM], args: argparse.Namespace) -> dict[str, Any]:
    """The hybrid manager's cost in time: ``--batch-prompts`` prompts of
    ``--batch-prompt-len`` tokens (shorter than the window: nothing to free, the per-step
    bookkeeping of more tables is all that differs), the modes in turns."""
    ids = prompt_ids(llms["hybrid"], args.batch_prompts * args.batch_prompt_len)
    n = args.batch_prompt_len
    prompts = [ids[i * n : (i + 1) * n] for i in range(args.batch_prompts)]
    runs: dict[str, list[float]] = {m: [] for m in llms}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.runs):
        for m, llm in llms.items():
            log(f"batch of {len(prompts)} x {n}, run {r + 1}/{args.runs}: {m}")
            tok_s, tokens[m] = batch_tok_s(llm, prompts, args.new_tokens)
            runs[m].append(tok_s)
    ratios = [h / o for h, o in zip(runs["hybrid"], runs["one-table"], strict=True)]
    row = {"prompts": len(prompts), "prompt_len": n, "tok_s": runs, "ratios": ratios,
           "ratio_median": statistics.median(ratios),
           "tokens_equal": tokens["hybrid"] == tokens["one-table"]}  # fmt: skip
    print(
        f"batch {len(prompts)} x {n} + {args.new_tokens}: hybrid / one table "
        f"{row['ratio_median']:.3f}x (runs {', '.join(f'{x:.3f}' for x in ratios)}); "
        f"tokens equal: {row['tokens_equal']}"
    )
    return row


def planner_bytes(llm: LLM, context: int) -> int:
    """``kvstack plan``'s per-request KV (``make_plan``) for this engine's model shapes,
    KV dtype and block size (the GPU and weights do not enter this figure)."""
    mc = llm.engine.model_config
    windows = [mc.layer_window(i) for i in range(mc.num_layers)]
    slides = [w for w in windows if w is not None]
    spec = ModelSpec(
        mc.name, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
        num_params=1, max_position_embeddings=mc.max_position_embeddings,
        sliding_window=max(slides) if slides else None, num_sliding_layers=len(slides),
    )  # fmt: skip
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    plan = make_plan(spec, resolve_gpu("80GiB"), context, dtype[llm.engine.dtype],
                     block_size=llm.engine.config.cache.block_size)  # fmt: skip
    return plan.kv_bytes_per_request


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="gemma3-270m", help="a model with sliding-window layers")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="runs per mode and context (medians)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--batch-prompts", type=int, default=32, help="0: skip the batch timing")
    p.add_argument("--batch-prompt-len", type=int, default=200)
    p.add_argument("--kv-press", default=None, help="press every request (e.g. snapkv)")
    p.add_argument("--kv-press-ratio", type=float, default=0.5, help="with --kv-press")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    args = p.parse_args()
    press = {}
    if args.kv_press:
        press = {"kv_press": args.kv_press, "kv_press_ratio": args.kv_press_ratio}
    info = machine_info()
    print(f"CPU {info.get('cpu_model')}; ISA {' '.join(info.get('cpu_flags', []))}")
    modes = {"hybrid": False, "one-table": True}
    llms = {
        m: LLM(
            args.model,
            dtype="bfloat16",
            kv_cache_memory=args.kv_cache_memory,
            disable_hybrid_kv_cache_manager=off,
        )
        for m, off in modes.items()
    }
    groups = llms["hybrid"].engine.kv_groups
    results: dict[str, Any] = {
        "machine": info, "model": args.model, "new_tokens": args.new_tokens,
        "groups": groups.describe() if groups is not None else None, "contexts": {},
        "press": press,
    }  # fmt: skip
    for ctx in args.contexts:
        ids = prompt_ids(llms["hybrid"], ctx)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(args.runs):
            for m in modes:
                log(f"context {ctx}, run {r + 1}/{args.runs}: {m}")
                runs[m].append(one_run(llms[m], ids, args.new_tokens, press))
        row: dict[str, Any] = {"planner_bytes": planner_bytes(llms["hybrid"], ctx)}
        for m, rs in runs.items():
            row[m] = {
                k: statistics.median(x[k] for x in rs)
                for k in ("ttft_s", "decode_tok_s", "peak_bytes", "end_bytes")
            }
            row[m]["runs"] = [{k: v for k, v in x.items() if k != "tokens"} for x in rs]
        row["tokens_equal"] = all(
            a["tokens"] == b["tokens"]
            for a, b in zip(runs["hybrid"], runs["one-table"], strict=True)
        )
        results["contexts"][str(ctx)] = row
        print_row(ctx, row)
    if args.batch_prompts:
        results["batch"] = batch_row(llms, args)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    write_json(results, RESULTS_DIR / f"hybrid_kv-{stamp}{args.tag}.json")


def print_row(ctx: int, row: dict[str, Any]) -> None:
    h, o = row["hybrid"], row["one-table"]
    mib = 2**20
    print(
        f"context {ctx}: KV held at the end {h['end_bytes'] / mib:.1f} MiB hybrid vs "
        f"{o['end_bytes'] / mib:.1f} MiB one table ({o['end_bytes'] / h['end_bytes']:.2f}x less); "
        f"peak {h['peak_bytes'] / mib:.1f} vs {o['peak_bytes'] / mib:.1f} MiB; planner "
        f"{row['planner_bytes'] / mib:.1f} MiB; TTFT {h['ttft_s']:.2f} vs {o['ttft_s']:.2f} s; "
        f"decode {h['decode_tok_s']:.1f} vs {o['decode_tok_s']:.1f} tok/s; "
        f"tokens equal: {row['tokens_equal']}"
    )


if __name__ == "__main__":
    main()
