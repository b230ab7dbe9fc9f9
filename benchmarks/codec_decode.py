"""Decode speed of every KV codec against uncompressed KV (``auto``), in one run (the
goal: int8 / fp8 at least 1.0x ``auto``, the others 0.9x; ``docs/kv/codecs.md``).

Whole-step decode throughput: ``--batch`` requests of ``--context`` random tokens are
prefilled (not timed), then every engine step until ``--new-tokens`` are generated is
timed (``LLMEngine.step()`` wall time, so attention, linears, the codec's KV write,
sampling and Python all count): decode tok/s = decoded tokens / summed step time. The
``auto`` engine stays loaded and each codec's engine (KV sized exactly for the workload)
loads in turn: ``--reps`` rounds, each ``auto`` then the codec, so a round's ratio is
measured on the same minute of a shared machine (the prompts hit the prefix cache after
round 1; only decode steps are timed). Reported: medians over rounds and the median of
the per-round ratios to ``auto``.

``--codecs auto`` alone measures ``auto`` for ``--reps`` rounds: run it from this file
with ``PYTHONPATH=<other checkout>/src`` (and its own ``KVSTACK_KERNEL_DIR``), in turns
with this tree's, to compare ``auto`` across commits.

``--eval-speed`` reruns the decode columns of the ``kvstack eval`` table on the docs'
codecs page (the
eval's own speed test, batch 8 by default there: pass ``--batch 8``).

``--attention-only`` instead times one layer's decode attention alone, single thread, min
of ``--reps`` calls: the PyTorch reference path (``gather`` + grouped matmuls) and the C++
kernel for each codec, on the same K/V (the microbenchmark behind the kernel's design).
With ``--cold`` a 150 MB buffer is streamed before every timed call (not timed), as a
decode step's weights stream between one layer's attention and the next token's, so the
KV comes from DRAM / L3 instead of L2 (a single user's row: ``--batch 1 --context 550``).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/codec_decode.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/codec_decode.py --attention-only --reps 20

Prints the CPU model and ISA flags; writes ``benchmarks/results/codec_decode-<date>.json``
(``/proc/loadavg`` before and after each round: a loaded machine contaminates the figures).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from kvstack import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
CODECS = ["auto", "int8", "fp8", "int4", "kivi2", "rotated4"]


def loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def machine() -> dict[str, Any]:
    """CPU model and ISA flags (self-contained, so the script also runs on older kvstack
    sources: ``PYTHONPATH=<main>/src`` measures ``auto`` before the
    codecs ran in the C++ kernels)."""
    text = Path("/proc/cpuinfo").read_text()
    model = next((ln for ln in text.splitlines() if ln.startswith("model name")), ":?")
    flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split()
    return {
        "cpu_model": model.split(":", 1)[1].strip(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2"))),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def decode_tok_s(llm: LLM, prompts: list[list[int]], new_tokens: int, tag: str) -> float:
    """Decoded tokens per second of summed step time, after an untimed prefill."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", None, sp, prompt_token_ids=p)
    sched = eng.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        eng.step()
    tokens, seconds = 0, 0.0
    while eng.has_unfinished_requests():
        n = len(sched.running)
        t0 = time.perf_counter()
        eng.step()
        seconds += time.perf_counter() - t0
        tokens += n
    return tokens / seconds


def _engine(args: argparse.Namespace, codec: str) -> LLM:
    blocks = args.batch * (-(-(args.context + args.new_tokens) // 16) + 1) + 8
    return LLM("default", dtype=args.dtype, kv_cache_dtype=codec, max_num_seqs=args.batch,
               num_blocks=blocks, block_size=16)  # fmt: skip


def run_engines(args: argparse.Namespace, save: Any = None) -> dict[str, Any]:
    """``auto`` stays loaded; each other codec loads in turn (memory: two engines at a
    time) and takes ``--reps`` rounds in turns with ``auto``: the ratio of each round is
    measured on the same minute of the machine."""
    auto = _engine(args, "auto")
    vocab = auto.engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.batch, args.context), generator=g).tolist()
    summary: dict[str, Any] = {}
    auto_all: list[float] = []
    if args.codecs == ["auto"]:  # auto alone: this source tree's auto, --reps rounds
        auto_all = [
            decode_tok_s(auto, prompts, args.new_tokens, f"a{rep}") for rep in range(args.reps)
        ]
        print(f"auto: {' '.join(f'{x:.1f}' for x in auto_all)} decode tok/s", flush=True)
    for c in [c for c in args.codecs if c != "auto"]:
        llm = _engine(args, c)
        rounds = []
        for rep in range(args.reps):
            row = {"loadavg_before": loadavg()}
            row["auto"] = decode_tok_s(auto, prompts, args.new_tokens, f"a{c}{rep}")
            row[c] = decode_tok_s(llm, prompts, args.new_tokens, f"r{rep}")
            row["loadavg_after"] = loadavg()
            rounds.append(row)
            print(
                f"{c:9s} round {rep + 1}: {row[c]:7.1f} vs auto {row['auto']:7.1f} decode "
                f"tok/s ({row[c] / row['auto']:.2f}x), load {row['loadavg_after']}",
                flush=True,
            )
        auto_all += [r["auto"] for r in rounds]
        summary[c] = {
            "rounds": rounds,
            "median_tok_s": statistics.median(r[c] for r in rounds),
            "auto_median_tok_s": statistics.median(r["auto"] for r in rounds),
            "ratio_vs_auto_median_of_rounds": statistics.median(r[c] / r["auto"] for r in rounds),
        }
        del llm
        gc.collect()
        summary["auto"] = {"median_tok_s": statistics.median(auto_all), "tok_s": auto_all}
        if save is not None:  # after each codec: a run cut short keeps what it measured
            save({"codecs": summary})
    summary["auto"] = {"median_tok_s": statistics.median(auto_all), "tok_s": auto_all}
    return {"codecs": summary}


def run_eval_speed(args: argparse.Namespace) -> dict[str, Any]:
    """The decode columns of ``kvstack eval`` (its own speed test, ``decode_throughput``
    on its seeded batch of ``--batch`` 512-token text prompts, 64 new tokens), rerun per
    codec, ``--reps`` interleaved rounds; the quality columns are not measured here."""
    import random

    from kvstack.tools.eval.corpus import make_text_ids
    from kvstack.tools.eval.tasks import (
        DECODE_OUTPUT_TOKENS,
        DECODE_PROMPT_TOKENS,
        decode_throughput,
    )

    blocks = args.batch * (-(-(DECODE_PROMPT_TOKENS + DECODE_OUTPUT_TOKENS) // 16) + 1) + 8
    llms = {
        c: LLM("default", dtype=args.dtype, kv_cache_dtype=c, max_num_seqs=max(args.batch, 8),
               num_blocks=blocks, block_size=16, max_num_batched_tokens=512)
        for c in args.codecs
    }  # fmt: skip
    tok = next(iter(llms.values())).tokenizer
    rng = random.Random("kvstack-eval-decode-0")
    prompts = [make_text_ids(tok, DECODE_PROMPT_TOKENS, rng) for _ in range(args.batch)]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.codecs}
    for rep in range(args.reps):
        for c, llm in llms.items():
            llm.engine.reset_prefix_cache()  # the eval measures with a cold prefix cache
            runs[c].append(decode_throughput(llm, prompts, DECODE_OUTPUT_TOKENS))
            sp = runs[c][-1]
            print(f"round {rep + 1}: {c:9s} {sp['output_tok_s']:7.1f} tok/s, decode-only "
                  f"{sp['decode_tok_s']:7.1f}", flush=True)  # fmt: skip
    out: dict[str, Any] = {}
    for c, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("output_tok_s", "decode_tok_s")}
        out[c] = {"runs": rs, **med}
    for c in out:
        if "auto" in out:
            out[c]["ratio_to_auto"] = out[c]["output_tok_s"] / out["auto"]["output_tok_s"]
    return {"eval_speed": out}


def run_attention_only(args: argparse.Namespace) -> dict[str, Any]:
    """One layer's decode attention, reference vs kernel, for each codec."""
    from kvstack.kv.codecs import CacheShape, codec_class
    from kvstack.model.attention import KernelRows
    from kvstack.model.kernels.loader import load_kernels

    kernels = load_kernels()
    assert kernels is not None, "the C++ kernels did not build"
    dtype = getattr(torch, args.dtype)
    b, ctx, h, kvh, d, bs = args.batch, args.context, 9, 3, 64, 16
    nblk = -(-ctx // bs)
    shape = CacheShape(1, b * nblk + 1, bs, kvh, d)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(b * nblk * bs, kvh, d, generator=g).to(dtype)
    v = torch.randn(b * nblk * bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    tables = (1 + torch.randperm(b * nblk, generator=g)).view(b, nblk)
    lens = torch.full((b,), ctx, dtype=torch.long)
    rows = KernelRows(b, tables, None, lens)
    over = torch.arange(nblk * bs)[None, :] >= lens[:, None]
    bias = torch.zeros(over.shape).masked_fill_(over, float("-inf"))[:, None, None, :]
    slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(-1)

    flush = torch.empty(150 * 2**20, dtype=torch.uint8) if args.cold else None
    out: dict[str, Any] = {}
    for name in args.codecs:
        codec = codec_class(name)(shape, dtype, max_num_seqs=b)
        codec.write(0, slots, k, v)
        out[name] = time_codec(
            kernels, codec, q, rows, bias, args.reps, not args.no_reference, flush
        )
        print(f"{name:9s} reference {out[name]['reference_ms']:8.2f} ms   kernel "
              f"{out[name]['kernel_ms']:8.2f} ms", flush=True)  # fmt: skip
    return {"attention_only": out, "threads": torch.get_num_threads(), "cold": args.cold}


def _best_ms(fn: Any, reps: int, flush: torch.Tensor | None = None) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if flush is not None:
            flush.add_(1)  # evicts the KV from the caches (not timed)
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def time_codec(
    kernels: Any,
    codec: Any,
    q: torch.Tensor,
    rows: Any,
    bias: torch.Tensor,
    reps: int,
    with_reference: bool = True,
    flush: torch.Tensor | None = None,
) -> dict[str, float]:
    """Min ms of the reference path (gather + grouped matmuls) and of the kernel."""
    from kvstack.model.attention import codec_attention, decode_attention

    b, kvh, d = q.shape[0], codec.shape.num_kv_heads, codec.shape.head_dim
    tables = rows.block_tables

    def reference() -> torch.Tensor:
        kk, vv = codec.gather(0, tables)
        return decode_attention(q, kk.view(b, -1, kvh, d), vv.view(b, -1, kvh, d), bias, 0.125)

    view = codec.kernel_view(0)
    if view is None:  # auto: the raw cache
        kc, vc = codec.k[0], codec.v[0]

        def kernel() -> torch.Tensor:
            return kernels.paged_attention(q, kc, vc, tables, None, rows.context_lens, 0.125)
    else:

        def kernel() -> torch.Tensor:
            return codec_attention(kernels, q, view, rows, 0.125)

    ref_ms = _best_ms(reference, reps, flush) if with_reference else float("nan")
    return {"reference_ms": ref_ms, "kernel_ms": _best_ms(kernel, reps, flush)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", nargs="+", default=CODECS, help="codecs, auto first")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="rounds (or calls with --attention-only)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attention-only", action="store_true", help="one layer, kernel vs reference")
    ap.add_argument("--no-reference", action="store_true", help="--attention-only: kernel only")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="--attention-only: stream 150 MB before every call (KV read from DRAM / L3)",
    )
    ap.add_argument(
        "--eval-speed", action="store_true", help="rerun the decode columns of `kvstack eval`"
    )
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    args = ap.parse_args()
    info = machine()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"CPU {info.get('cpu_model')}; {' '.join(info.get('cpu_flags', []))}")
    print(f"commit {commit}, torch {info['torch']}, {info['threads']} threads, load {loadavg()}")
    result: dict[str, Any] = {
        "benchmark": "codec_decode",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {**info, "git_commit": commit},
        "batch": args.batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "loadavg_start": loadavg(),
    }
    if args.attention_only:
        result.update(run_attention_only(args))
    elif args.eval_speed:
        result.update(run_eval_speed(args))
    kind = "attention" if args.attention_only else "eval_speed" if args.eval_speed else "decode"
    name = f"codec_{kind}-{dt.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json"
    RESULTS.mkdir(exist_ok=True)

    def save(part: dict[str, Any]) -> None:
        (RESULTS / name).write_text(json.dumps({**result, **part}, indent=1) + "\n")

    if not (args.attention_only or args.eval_speed):
        result.update(run_engines(args, save))
    result["loadavg_end"] = loadavg()
    (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    if not (args.attention_only or args.eval_speed):
        print("| codec | decode tok/s (median) | × auto (median of rounds) |")
        print("|---|---:|---:|")
        for c, e in sorted(result["codecs"].items(), key=lambda kv: kv[0] != "auto"):
            ratio = e.get("ratio_vs_auto_median_of_rounds", 1.0)
            print(f"| {c} | {e['median_tok_s']:.1f} | {ratio:.2f} |")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
