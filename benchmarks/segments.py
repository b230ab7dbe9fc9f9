"""Segment reuse against full prefill and prefix caching (issue 18).

One engine per mode, the same model, dtype and pool: ``full`` (no prefix cache, no
segments), ``prefix`` (vLLM's hash prefix cache) and ``seg-rX`` (prefix cache plus
segment reuse recomputing X % of each placed segment, CacheBlend's selection, after its
first ``--first`` tokens: EPIC). The workload (``agent-tools-shuffled``: 3-8 of 20 tool
schemas in random order, or ``rag-shuffled``) runs one request at a time in its order, so
a request's time to first token is its own prefill against what the earlier ones left in
the cache, as on a long-running server; ``--runs`` passes on fresh engines, medians.

Reported per mode: TTFT (median over requests, median of the runs), prompt tokens
computed per request (standalone segment prefills and repair rows included), KV blocks
(a request's block table, prefix-cache blocks it adopted, the segment store), and
quality against ``full``: teacher-forced KL(full || mode) and top-1 agreement on the
answer ``full`` generates greedily (``LLM.score``), and greedy agreement (tokens equal
before the first difference). Not measured here: attention time alone, tool-call
argument validity with ``tool_choice`` auto (the 135M default model rarely calls tools).

Prints the CPU model and ISA flags; writes ``benchmarks/results/segments-<date><tag>.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import torch

from bench_common import RESULTS_DIR, log, write_json
from kvstack import LLM, SamplingParams
from kvstack.tools.workloads import make_workload
from kvstack.tools.workloads.spec import WorkloadRequest
from offline_throughput import machine_info

RATIOS = (0.0, 0.05, 0.15, 0.30, 1.0)
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def modes(first: int, ratios: tuple[float, ...]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "full": {"prefix_cache": "none", "segment_cache": "none"},
        "prefix": {"segment_cache": "none"},
    }
    for r in ratios:
        out[f"seg-r{round(r * 100)}"] = {
            "segment_recompute_ratio": r, "segment_recompute_tokens": first,
        }  # fmt: skip
    return out


def spans(req: WorkloadRequest, mode: str) -> list[tuple[int, int]] | None:
    if not mode.startswith("seg") or not req.segments:
        return None
    return [(s, e) for s, e in req.segments]


def one_pass(llm: LLM, work: list[WorkloadRequest], mode: str) -> dict[str, Any]:
    """Every request alone, in order: TTFT, computed tokens and blocks per request."""
    eng = llm.engine
    bs = eng.kv_manager.block_size
    ttft, computed, adopted = [], [], []
    for req in work:
        before = eng.stats().prefill_tokens_computed
        t0 = time.perf_counter()
        out = llm.generate(
            prompt_token_ids=[req.prompt_token_ids], sampling_params=ONE,
            segments=[spans(req, mode)], use_tqdm=False,
        )[0]  # fmt: skip
        ttft.append(time.perf_counter() - t0)
        computed.append(eng.stats().prefill_tokens_computed - before)
        adopted.append(out.num_cached_tokens // bs)
    seg = eng.scheduler.segments
    return {
        "ttft_s": statistics.median(ttft),
        "computed_tokens": statistics.mean(computed),
        "request_blocks": statistics.mean(math.ceil(len(r.prompt_token_ids) / bs) for r in work),
        "adopted_blocks": statistics.mean(adopted),
        "segment_store_blocks": seg.cache.num_blocks if seg is not None else 0,
        "segments": eng.stats().segments,
    }


def quality(
    llm: LLM, work: list[WorkloadRequest], mode: str, answers: list[list[int]],
    refs: list[torch.Tensor],
) -> dict[str, float]:  # fmt: skip
    """Teacher-forced KL / top-1 on ``full``'s answers, and greedy agreement."""
    kls, top1, agree = [], [], []
    n = len(answers[0])
    for req, answer, ref in zip(work, answers, refs, strict=True):
        ids = req.prompt_token_ids
        lp = llm.score(ids + answer, start=len(ids), segments=spans(req, mode)).float()
        p = ref.float()
        kls.append(float((p.exp() * (p - lp)).sum(-1).mean()))
        top1.append(float((p.argmax(-1) == lp.argmax(-1)).float().mean()))
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        got = llm.generate(
            prompt_token_ids=[ids], sampling_params=sp, segments=[spans(req, mode)],
            use_tqdm=False,
        )[0].outputs[0].token_ids  # fmt: skip
        same = next((i for i, (a, b) in enumerate(zip(got, answer, strict=True)) if a != b), n)
        agree.append(same / n)
    return {
        "kl": statistics.mean(kls),
        "top1": statistics.mean(top1),
        "greedy_agreement": statistics.mean(agree),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="agent-tools-shuffled",
                    choices=("agent-tools-shuffled", "rag-shuffled"))  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3, help="passes on fresh engines (medians)")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--first", type=int, default=16, help="EPIC's first-k tokens recomputed")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)),
                    help="recompute ratios of the seg-rX modes, comma-separated")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="default")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    args = ap.parse_args()
    info = machine_info()
    log(f"CPU: {info.get('cpu_model')} flags {' '.join(info.get('cpu_flags', []))}")
    opts = {"dtype": args.dtype, "num_blocks": 1024, "max_num_batched_tokens": 4096}
    probe = LLM(args.model, **opts)
    work = make_workload(args.workload, probe.tokenizer, args.num_requests)
    full_sp = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    outs = probe.generate(
        prompt_token_ids=[r.prompt_token_ids for r in work], sampling_params=full_sp
    )
    answers = [o.outputs[0].token_ids for o in outs]
    del probe
    results: dict[str, Any] = {}
    refs: list[torch.Tensor] = []
    ratios = tuple(float(r) for r in args.ratios.split(","))
    for mode, kw in modes(args.first, ratios).items():
        passes = []
        for run in range(args.runs):
            llm = LLM(args.model, **opts, **kw)
            passes.append(one_pass(llm, work, mode))
            log(f"{mode} run {run}: TTFT {passes[-1]['ttft_s'] * 1e3:.0f} ms, "
                f"{passes[-1]['computed_tokens']:.0f} tokens computed")  # fmt: skip
        row = {k: statistics.median(p[k] for p in passes) for k in ("ttft_s", "computed_tokens")}
        row |= {k: passes[-1][k] for k in passes[-1] if k not in row}
        row["ttft_runs_s"] = [p["ttft_s"] for p in passes]
        if mode == "full":
            refs = [llm.score(r.prompt_token_ids + a, start=len(r.prompt_token_ids))
                    for r, a in zip(work, answers, strict=True)]  # fmt: skip
        row |= quality(llm, work, mode, answers, refs)
        results[mode] = row
        log(f"{mode}: {row}")
    summary = summarize(results)
    for line in summary["table"]:
        print(line)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d")
    write_json(
        {"machine": info, "args": vars(args), "modes": results, "summary": summary},
        RESULTS_DIR / f"segments-{stamp}{args.tag}.json",
    )


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios to prefix caching, the default ratio (smallest with top-1 >= 0.95)."""
    pre = results["prefix"]
    table = [
        "| mode | TTFT ms | vs prefix | tokens computed | vs prefix | KL | top-1 | greedy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in results.items():
        table.append(
            f"| {mode} | {r['ttft_s'] * 1e3:.0f} | {pre['ttft_s'] / r['ttft_s']:.2f}x | "
            f"{r['computed_tokens']:.0f} | {r['computed_tokens'] / pre['computed_tokens']:.2f} | "
            f"{r['kl']:.4f} | {r['top1']:.3f} | {r['greedy_agreement']:.2f} |"
        )
    ok = [m for m in results if m.startswith("seg") and results[m]["top1"] >= 0.95]
    best = min(ok, key=lambda m: int(m.split("-r")[1])) if ok else None
    return {"table": table, "default_ratio_mode": best}


if __name__ == "__main__":
    main()
