"""Segment reuse against full prefill and prefix caching
(``docs/kv/segments.md``).

One engine per mode, the same model, dtype and pool: ``full`` (no prefix cache, no
segments), ``prefix`` (vLLM's hash prefix cache) and ``seg-rX`` (prefix cache plus
segment reuse recomputing X % of each placed segment, CacheBlend's selection, after its
first ``--first`` tokens: EPIC; each tool computed after the tool primer, as the server
marks it, ``serve/chat/segment_primers.py``) and ``seg-rX-noprimer`` (one ratio, every
segment computed after BOS only: what the primer changes, same run). The workload
(``agent-tools-shuffled``: 3-8 of 20 tool
schemas in random order, or ``rag-shuffled``) runs one request at a time in its order, so
a request's time to first token is its own prefill against what the earlier ones left in
the cache, as on a long-running server; ``--runs`` passes on fresh engines, medians.

Reported per mode: TTFT (median over requests, median of the runs), prompt tokens
computed per request (standalone segment prefills and repair rows included), KV blocks
(a request's block table, prefix-cache blocks it adopted, the segment store), and
quality against ``full``: teacher-forced KL(full || mode) and top-1 agreement on the
answer ``full`` generates greedily (``LLM.score``), and greedy agreement (tokens equal
before the first difference); attention time (the model's ``paged_attention`` calls of a
request, every layer, timed around each call); and tool calls (``agent-tools-shuffled``):
with ``tool_choice`` auto, the share of outputs that are valid calls (hermes parser, a
listed tool, arguments valid against its schema: jsonschema), and with ``tool_choice``
required (the server's own grammar, one call) the share whose function and arguments
equal ``full``'s call. All requests of a tool pass run as one batch (a result does not
depend on its batch mates).

Prints the CPU model and ISA flags; writes ``benchmarks/results/segments-<date><tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from datetime import UTC, datetime
from typing import Any

import jsonschema
import torch

import kvstack.model.arch.decoder as llama_mod
import kvstack.model.arch.gemma3_decoder as gemma3_mod
from bench_common import RESULTS_DIR, log, write_json
from kvstack import LLM, SamplingParams
from kvstack.serve.api.protocol_tools import ToolDef
from kvstack.serve.chat.tool_calls import ToolPlan
from kvstack.serve.chat.tool_parsers import TOOL_PARSERS
from kvstack.tools.workloads import make_workload
from kvstack.tools.workloads.spec import WorkloadRequest
from offline_throughput import machine_info

RATIOS = (0.0, 0.05, 0.15, 0.30, 1.0)
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def modes(first: int, ratios: tuple[float, ...], bare: float | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "full": {"prefix_cache": "none", "segment_cache": "none"},
        "prefix": {"segment_cache": "none"},
    }
    for r in ratios:
        out[f"seg-r{round(r * 100)}"] = {
            "segment_recompute_ratio": r, "segment_recompute_tokens": first,
        }  # fmt: skip
    if bare is not None:  # the same, every segment computed after BOS only (no primer)
        out[f"seg-r{round(bare * 100)}-noprimer"] = {
            "segment_recompute_ratio": bare, "segment_recompute_tokens": first,
        }  # fmt: skip
    return out


def spans(req: WorkloadRequest, mode: str) -> list[list[Any]] | None:
    """The request's marks in ``mode`` (a tool's with its primer, as the server's)."""
    if not mode.startswith("seg") or not req.segments:
        return None
    if mode.endswith("-noprimer"):
        return [m[:2] for m in req.segments]
    return [list(m) for m in req.segments]


class AttentionTimer:
    """Wall time inside the model's ``paged_attention`` (every layer), while installed
    (in the Llama and the Gemma 3 forward)."""

    MODULES = (llama_mod, gemma3_mod)

    def __init__(self) -> None:
        self.seconds = 0.0
        self.inner = llama_mod.paged_attention

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def __enter__(self) -> AttentionTimer:
        for mod in self.MODULES:
            mod.paged_attention = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for mod in self.MODULES:
            mod.paged_attention = self.inner


def one_pass(llm: LLM, work: list[WorkloadRequest], mode: str) -> dict[str, Any]:
    """Every request alone, in order: TTFT, attention time, computed tokens and blocks."""
    eng = llm.engine
    bs = eng.kv_manager.block_size
    ttft, attn, computed, adopted = [], [], [], []
    for req in work:
        before = eng.stats().prefill_tokens_computed
        with AttentionTimer() as timer:
            t0 = time.perf_counter()
            out = llm.generate(
                prompt_token_ids=[req.prompt_token_ids], sampling_params=ONE,
                segments=[spans(req, mode)], use_tqdm=False,
            )[0]  # fmt: skip
            ttft.append(time.perf_counter() - t0)
        attn.append(timer.seconds)
        computed.append(eng.stats().prefill_tokens_computed - before)
        adopted.append(out.num_cached_tokens // bs)
    seg = eng.scheduler.segments
    return {
        "ttft_s": statistics.median(ttft),
        "attention_s": statistics.median(attn),
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


def tool_defs(req: WorkloadRequest) -> list[ToolDef]:
    return [ToolDef.model_validate(t) for t in (req.body_extra or {}).get("tools", [])]


def tool_calls(
    llm: LLM, work: list[WorkloadRequest], mode: str, choice: str, max_tokens: int
) -> list[list[tuple[str, Any]]]:
    """Each request's parsed calls ``(name, arguments)`` under ``tool_choice`` ``choice``
    (auto: free text, parsed; required: one call, the server's grammar); invalid calls
    (unknown tool, arguments not valid against its schema) are dropped."""
    parser = TOOL_PARSERS["hermes"]()
    params = []
    for req in work:
        plan = ToolPlan.build(tool_defs(req), choice, False, "hermes")
        assert plan is not None
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                     structured_outputs=plan.constraint()))  # fmt: skip
    outs = llm.generate(
        prompt_token_ids=[r.prompt_token_ids for r in work], sampling_params=params,
        segments=[spans(r, mode) for r in work], use_tqdm=False,
    )  # fmt: skip
    found: list[list[tuple[str, Any]]] = []
    for req, out in zip(work, outs, strict=True):
        schemas = {t.function.name: t.function.parameters or {} for t in tool_defs(req)}
        calls = []
        for call in parser.extract(out.outputs[0].text, set(schemas)).tool_calls:
            args = json.loads(call.arguments)
            try:
                jsonschema.validate(args, schemas[call.name])
            except (jsonschema.ValidationError, KeyError):
                continue
            calls.append((call.name, args))
        found.append(calls)
    return found


def tool_quality(
    llm: LLM, work: list[WorkloadRequest], mode: str, ref: list[list[tuple[str, Any]]] | None
) -> tuple[dict[str, float], list[list[tuple[str, Any]]]]:
    """Valid calls under auto; under required, of the requests where ``ref`` (``full``)
    made a valid call, the share whose call (function, or function and arguments) is
    ``ref``'s."""
    auto = tool_calls(llm, work, mode, "auto", 96)
    forced = tool_calls(llm, work, mode, "required", 256)
    ref = forced if ref is None else ref
    pairs = [(a, b) for a, b in zip(forced, ref, strict=True) if b]  # full made a valid call
    n, m = len(work), max(1, len(pairs))
    return {
        "auto_valid_calls": sum(bool(c) for c in auto) / n,
        "required_valid_calls": sum(bool(c) for c in forced) / n,
        "required_same_function": sum(bool(a) and a[0][0] == b[0][0] for a, b in pairs) / m,
        "required_same_call": sum(a == b for a, b in pairs) / m,
    }, forced  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="agent-tools-shuffled",
                    choices=("agent-tools-shuffled", "rag-shuffled"))  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3, help="passes on fresh engines (medians)")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--first", type=int, default=32, help="EPIC's first-k tokens recomputed")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)),
                    help="recompute ratios of the seg-rX modes, comma-separated")  # fmt: skip
    ap.add_argument("--no-primer-ratio", type=float, default=0.15,
                    help="also run this ratio without the tool primer (-1: not)")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default="default")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                    help="one block table for all layers: how a sliding-window model "
                    "(gemma3-270m) places segments")  # fmt: skip
    ap.add_argument("--chat-template", default=None,
                    help="a chat template file for a model without one (gemma3-270m: "
                    "benchmarks/templates/gemma3_tools.jinja)")  # fmt: skip
    args = ap.parse_args()
    info = machine_info()
    log(f"CPU: {info.get('cpu_model')} flags {' '.join(info.get('cpu_flags', []))}")
    opts = {"dtype": args.dtype, "num_blocks": 1024, "max_num_batched_tokens": 4096,
            "disable_hybrid_kv_cache_manager": args.disable_hybrid_kv_cache_manager,
            "chat_template": args.chat_template}  # fmt: skip
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
    ref_calls: list[list[tuple[str, Any]]] | None = None
    ratios = tuple(float(r) for r in args.ratios.split(","))
    bare = args.no_primer_ratio if args.no_primer_ratio >= 0 else None
    for mode, kw in modes(args.first, ratios, bare).items():
        passes = []
        for run in range(args.runs):
            llm = LLM(args.model, **opts, **kw)
            passes.append(one_pass(llm, work, mode))
            log(f"{mode} run {run}: TTFT {passes[-1]['ttft_s'] * 1e3:.0f} ms, "
                f"{passes[-1]['computed_tokens']:.0f} tokens computed")  # fmt: skip
        row = {k: statistics.median(p[k] for p in passes) for k in ("ttft_s", "computed_tokens")}
        row |= {k: passes[-1][k] for k in passes[-1] if k not in row}
        row["ttft_runs_s"] = [p["ttft_s"] for p in passes]
        row["attention_s"] = statistics.median(p["attention_s"] for p in passes)
        if mode == "full":
            refs = [llm.score(r.prompt_token_ids + a, start=len(r.prompt_token_ids))
                    for r, a in zip(work, answers, strict=True)]  # fmt: skip
        row |= quality(llm, work, mode, answers, refs)
        if args.workload == "agent-tools-shuffled":
            tools, calls = tool_quality(llm, work, mode, ref_calls)
            ref_calls = calls if mode == "full" else ref_calls
            row["tools"] = tools
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
        "| mode | TTFT ms | vs prefix | attention ms | vs prefix | tokens computed | vs prefix "
        "| own blocks | store blocks | KL | top-1 | greedy | calls (auto) | same call (required) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in results.items():
        tools = r.get("tools", {})
        own = r["request_blocks"] - r["adopted_blocks"]
        table.append(
            f"| {mode} | {r['ttft_s'] * 1e3:.0f} | {pre['ttft_s'] / r['ttft_s']:.2f}x | "
            f"{r['attention_s'] * 1e3:.0f} | {pre['attention_s'] / r['attention_s']:.2f}x | "
            f"{r['computed_tokens']:.0f} | {r['computed_tokens'] / pre['computed_tokens']:.2f} | "
            f"{own:.1f} | {r['segment_store_blocks']} | {r['kl']:.4f} | {r['top1']:.3f} | "
            f"{r['greedy_agreement']:.2f} | "
            f"{tools.get('auto_valid_calls', float('nan')):.2f} | "
            f"{tools.get('required_same_call', float('nan')):.2f} |"
        )
    ok = [m for m in results if m.startswith("seg") and results[m]["top1"] >= 0.95]
    ok = [m for m in ok if not m.endswith("-noprimer")]
    best = min(ok, key=lambda m: int(m.split("-r")[1])) if ok else None
    return {"table": table, "default_ratio_mode": best}


if __name__ == "__main__":
    main()
