"""KV-cache eras: one workload, one KV memory budget, five ways to manage the cache.

An *era* is a generation of KV-cache management, as ``docs/design.md`` defines them: a
contiguous slab per request, paged blocks, prefix reuse, then tiers and KV compression
(the last two are measured by their own benchmarks). Every setup here is the same engine,
model, KV pool (``--kv-cache-memory``), ``max_model_len`` and ``max_num_seqs``; only the
``LLM(...)`` arguments below differ, so what each era buys is measured, not assumed:

  setup               LLM(...)                                     KV reserved per request
  ------------------  -------------------------------------------  -------------------------
  contiguous          kv_layout="contiguous", prefix_cache="none"  one max_model_len slab
  contiguous-request  kv_layout="contiguous-request",              one prompt + max_tokens
                      prefix_cache="none"                          slab
  paged               kv_layout="paged", prefix_cache="none"       16-token blocks on demand
  prefix-hash         prefix_cache="hash"                          blocks; full prompt blocks
                                                                   shared by chained hash
  prefix-radix        prefix_cache="radix"                         blocks; prefixes shared via
                                                                   a radix tree

The contiguous setups are pre-PagedAttention serving (internal fragmentation caps
concurrency), ``paged`` is vLLM's paged KV (Kwon et al., 2023), and the prefix setups add
prefix reuse (vLLM's automatic prefix caching, SGLang's RadixAttention).

Procedure per workload (``kvstack.tools.workloads``; requests of round k run after rounds
< k, one ``generate`` call per round, wall time summed over rounds) and era: build the LLM,
run one untimed warm-up (2 short prompts), then ``--runs`` timed runs, each after
``reset_prefix_cache()`` and a reset of the usage tracker and peak-concurrency counter.
Greedy decoding, EOS ignored, so every era generates the same number of tokens. Before each
run the machine must be idle (``--wait-idle``); a run during which other processes used
more than 0.1 core is repeated (``--retries``, twice per era by default).

Metrics (medians over runs; every run is kept in the JSON): output tok/s (output tokens /
wall) and its ratio to paged's, KV waste % (time-averaged reserved-but-unwritten slots
/ pool slots), peak concurrent requests, prefix hit rate (cached prompt tokens / prompt
tokens), prefill tokens computed, TTFT p50/p99 and E2E p50 (ms, from each request's
arrival in its round), preemptions, and the fraction of requests whose greedy tokens equal
paged's (first run; bf16 numerics may flip a few, so this is reported, not enforced).

Results: ``benchmarks/results/eras-<workload>-<date>.json`` (merged: a rerun replaces the
entry of the same workload and settings), a markdown table on stdout, a 2x2 bar chart
``benchmarks/results/eras-<workload>.png`` (needs matplotlib), and ``--write-readme``
re-renders the docs' measured tables from the results
(``benchmarks/docs_tables.py``): the eras tables of ``docs/design.md``.

Examples::

    .venv/bin/python benchmarks/eras.py --workload shared-prefix --shared-prefix-len 1000
    .venv/bin/python benchmarks/eras.py --workload all --write-readme
    .venv/bin/python benchmarks/eras.py --quick --eras paged,prefix-hash
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_common import RESULTS_DIR, LoadMeter, log, median, render_docs, wait_for_idle, write_json
from eras_plot import (
    REFERENCE_ERA,
    markdown_table,
    plot_eras,
    settings_line,
)

ERAS: dict[str, dict[str, str]] = {
    "contiguous": {"kv_layout": "contiguous", "prefix_cache": "none"},
    "contiguous-request": {"kv_layout": "contiguous-request", "prefix_cache": "none"},
    "paged": {"kv_layout": "paged", "prefix_cache": "none"},
    "prefix-hash": {"kv_layout": "paged", "prefix_cache": "hash"},
    "prefix-radix": {"kv_layout": "paged", "prefix_cache": "radix"},
}
MAX_OTHER_LOAD = 0.1  # cores other processes may use during a timed run


# --------------------------------------------------------------------------- measuring


def percentile(values: Sequence[float], q: float) -> float:
    """``q``-th percentile with linear interpolation (numpy's default); NaN when empty."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def timed_run(llm: Any, rounds: list[list[Any]], use_tqdm: bool) -> tuple[dict, list[list[int]]]:
    """One timed pass over the workload's rounds; returns (metrics, output ids per request).

    Counters that the engine keeps cumulatively are taken as differences; the averaged
    ones (usage, waste) and the peak concurrency are reset first.
    """
    from kvstack import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()
    engine.usage_tracker.reset()
    engine.scheduler.max_num_running = 0
    before = llm.get_stats()
    outputs: list[Any] = []
    wall = 0.0
    with LoadMeter() as meter:
        for batch in rounds:
            params = [
                SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                for r in batch
            ]
            t0 = time.perf_counter()
            outs = llm.generate(
                prompt_token_ids=[r.prompt_token_ids for r in batch],
                sampling_params=params,
                use_tqdm=use_tqdm,
            )
            wall += time.perf_counter() - t0
            engine.usage_tracker.pause()  # the gap between rounds is not KV time
            outputs.extend(outs)
    after = llm.get_stats()
    requests = [r for batch in rounds for r in batch]
    if len(outputs) != len(requests) or any(o.error for o in outputs):
        errors = sorted({str(o.error) for o in outputs if o.error})
        raise RuntimeError(f"{len(outputs)}/{len(requests)} outputs; errors: {errors}")
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    short = sum(len(i) != r.max_tokens for i, r in zip(ids, requests, strict=True))
    if short:
        raise RuntimeError(f"{short} requests did not generate exactly max_tokens tokens")
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    out_tokens = sum(map(len, ids))
    ttft = [o.metrics.ttft * 1e3 for o in outputs if o.metrics and o.metrics.ttft is not None]
    e2e = [
        (o.metrics.finished_time - o.metrics.arrival_time) * 1e3
        for o in outputs
        if o.metrics and o.metrics.finished_time is not None
    ]
    metrics = {
        "wall_s": round(wall, 4),
        "prompt_tokens": prompt,
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall, 2),
        "cached_tokens": cached,
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prefill_tokens_computed": after.prefill_tokens_computed - before.prefill_tokens_computed,
        "kv_waste_pct": round(after.kv_waste_avg * 100, 3),
        "kv_waste_peak_pct": round(after.kv_waste_peak * 100, 3),
        "kv_usage_avg_pct": round(after.kv_usage_avg * 100, 3),
        "max_concurrent": after.max_num_running,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "num_evicted_blocks": after.num_evicted_blocks - before.num_evicted_blocks,
        "num_steps": after.num_steps - before.num_steps,
        "ttft_p50_ms": round(percentile(ttft, 50), 2),
        "ttft_p99_ms": round(percentile(ttft, 99), 2),
        "e2e_p50_ms": round(percentile(e2e, 50), 2),
        "e2e_p99_ms": round(percentile(e2e, 99), 2),
        "own_cores": round(meter.own_cores, 2),
        "other_load_cores": round(meter.other_cores, 2),
    }
    return metrics, ids


def run_era(era: str, rounds: list[list[Any]], args: argparse.Namespace, tag: str) -> dict:
    """Build the era's LLM, warm it up, time ``args.runs`` runs; medians and all runs."""
    from kvstack import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model="default",
        dtype="bfloat16",
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        eviction_policy="lru",
        **ERAS[era],
    )
    load_s = time.perf_counter() - t0
    kv = llm.engine.kv_manager
    warm = [r.prompt_token_ids[:64] for r in rounds[0][:2]]
    llm.generate(
        prompt_token_ids=warm, sampling_params=SamplingParams(max_tokens=4), use_tqdm=False
    )
    runs: list[dict] = []
    discarded: list[dict] = []
    first_ids: list[list[int]] = []
    while len(runs) < args.runs:
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle)
        metrics, ids = timed_run(llm, rounds, args.tqdm)
        line = (
            f"[{tag}] {era} run {len(runs) + 1}/{args.runs}: {metrics['wall_s']:.2f} s, "
            f"{metrics['output_tok_s']:.1f} out tok/s, hit {metrics['prefix_hit_rate']:.2f}, "
            f"waste {metrics['kv_waste_pct']:.1f} %, peak {metrics['max_concurrent']} running, "
            f"{metrics['num_preemptions']} preemptions (others {metrics['other_load_cores']} cores)"
        )
        if metrics["other_load_cores"] > MAX_OTHER_LOAD and len(discarded) < args.retries:
            discarded.append(metrics)
            log(f"{line}: machine busy, repeated")
            continue
        log(line)
        runs.append(metrics)
        first_ids = first_ids or ids
    del llm
    gc.collect()
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {
        "era": era,
        "config": {**ERAS[era], "num_blocks": kv.num_blocks, "block_size": kv.block_size},
        "load_s": round(load_s, 2),
        "median": {k: round(median([r[k] for r in runs]), 4) for k in keys},
        "runs": runs,
        "discarded_runs": discarded,
        "output_ids": first_ids,
    }


def compare(entries: list[dict]) -> str | None:
    """Add each era's tok/s ratio and greedy agreement with the reference era, in place.

    The reference is ``paged``, or the first era that ran when it was not selected.
    """
    done = [e for e in entries if "error" not in e]
    ref = next((e for e in done if e["era"] == REFERENCE_ERA), done[0] if done else None)
    if ref is None:
        return None
    for e in done:
        e["tok_s_vs_ref"] = round(e["median"]["output_tok_s"] / ref["median"]["output_tok_s"], 3)
        pairs = list(zip(e["output_ids"], ref["output_ids"], strict=True))
        e["same_output_as_ref"] = round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4)
    for e in done:
        e.pop("output_ids")
    return str(ref["era"])


# --------------------------------------------------------------------------- main


def parse_knob(text: str) -> tuple[str, int | float]:
    """``KNOB=VALUE`` of ``--set``; the value is an int when it looks like one."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KNOB=VALUE, got {text!r}")
    try:
        return key.strip(), int(value) if value.strip().lstrip("-").isdigit() else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: not a number: {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """Command-line options."""
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        description=doc.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(doc.splitlines()[1:]),
    )
    p.add_argument(
        "--workload",
        default="shared-prefix",
        help="workload of kvstack.tools.workloads (random, shared-prefix, multi-turn, few-shot, "
        "rag-qa, agent-tools) or 'all' to run each in turn into one result file "
        "(default shared-prefix)",
    )
    p.add_argument("--num-requests", type=int, default=32, help="requests per run (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (64)")
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=None,
        help="shared-prefix only: tokens each group's prompts share (workload default 144)",
    )
    p.add_argument(
        "--set",
        dest="knobs",
        type=parse_knob,
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="workload knob (see `python -m kvstack.tools.workloads --help`), e.g. "
        "doc_len=500; applied to the workloads that have it; repeatable",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--eras", default=",".join(ERAS), help=f"comma list of eras (default: {','.join(ERAS)})"
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs per era; medians (3)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV pool of every era (256MiB)")
    p.add_argument("--max-model-len", type=int, default=2048, help="context limit (2048)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="concurrency limit (32)")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=60.0,
        help="before each timed run wait up to this many seconds for the machine to be idle "
        "(0: don't wait)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help=f"per era, repeat at most this many runs during which other processes used more "
        f"than {MAX_OTHER_LOAD} core (default 2)",
    )
    p.add_argument("--out", type=Path, default=None, help="result JSON (default: dated file)")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG path (default benchmarks/results/eras-<workload>.png; with --workload all "
        "the workload is added to the name)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--write-readme", action="store_true", help="then re-render the docs' tables")
    p.add_argument(
        "--tqdm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar per generate call (default: when stderr is a terminal)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 8 requests x 8 new tokens, 1 run, no idle wait or retries; "
        "results go to -quick files",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    """Run every selected era on every selected workload; write JSON, table, plot."""
    args = build_parser().parse_args(argv)
    from kvstack.model.loader.registry import load_tokenizer
    from kvstack.tools.workloads import DEFAULTS, WORKLOADS, make_workload, summarize
    from offline_throughput import machine_info

    if args.quick:
        args.num_requests, args.max_tokens, args.runs, args.wait_idle = 8, 8, 1, 0.0
        args.retries = 0
    if args.tqdm is None:
        args.tqdm = sys.stderr.isatty()
    eras = [e.strip() for e in args.eras.split(",") if e.strip()]
    if bad := [e for e in eras if e not in ERAS]:
        raise SystemExit(f"unknown eras {bad}; valid: {', '.join(ERAS)}")
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    if bad := [w for w in workloads if w not in WORKLOADS]:
        raise SystemExit(f"unknown workload {bad}; valid: {', '.join(WORKLOADS)}, all")
    knobs = dict(args.knobs)
    if args.shared_prefix_len is not None:
        knobs["shared_prefix_len"] = args.shared_prefix_len
    if unknown := [k for k in knobs if not any(k in d for d in DEFAULTS.values())]:
        raise SystemExit(f"unknown workload knobs {unknown}")

    date = dt.date.today().isoformat()
    suffix = "-quick" if args.quick else ""
    out: Path = args.out or RESULTS_DIR / f"eras-{args.workload}-{date}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if doc.get("benchmark") != "eras":
        doc = {}
    import torch

    doc.update(
        benchmark="eras",
        date=date,
        file=out.name,
        machine={**machine_info(), "torch": torch.__version__, "threads": torch.get_num_threads()},
    )
    results: list[dict] = doc.setdefault("results", [])
    tokenizer = load_tokenizer("default")
    for wl in workloads:
        overrides = {k: v for k, v in knobs.items() if k in DEFAULTS[wl]}
        reqs = make_workload(
            wl, tokenizer, args.num_requests, args.seed, args.max_tokens, **overrides
        )
        rounds = [[r for r in reqs if r.round == k] for k in sorted({r.round for r in reqs})]
        summary = summarize(reqs)
        log(f"[{wl}] {json.dumps(summary)}; eras: {', '.join(eras)}")
        settings = {
            k: getattr(args, k)
            for k in ("num_requests", "max_tokens", "seed", "runs", "kv_cache_memory")
        }
        settings.update(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
        res: dict[str, Any] = {
            "workload": wl,
            "overrides": overrides,
            "settings": settings,
            "workload_summary": summary,
            "measured_at": dt.datetime.now().isoformat(timespec="seconds"),
            "eras": [],
        }
        for era in eras:
            try:
                res["eras"].append(run_era(era, rounds, args, wl))
            except Exception as exc:  # one failing era must not lose the others
                log(f"[{wl}] {era} FAILED: {exc!r}")
                res["eras"].append({"era": era, "error": repr(exc)[:300]})
        res["reference_era"] = compare(res["eras"])
        key = (wl, overrides, settings)
        results[:] = [r for r in results if (r["workload"], r["overrides"], r["settings"]) != key]
        results.append(res)
        write_json(doc, out)  # after every workload, so that a later failure keeps results
        print(f"\n{wl}: {settings_line(res)}\n\n{markdown_table(res)}\n", flush=True)
        if not args.no_plot:
            plot = args.plot or RESULTS_DIR / f"eras-{wl}{suffix}.png"
            if args.plot and len(workloads) > 1:
                plot = plot.with_name(f"{plot.stem}-{wl}{plot.suffix}")
            if plot_eras(res, plot, f"{wl}: {settings_line(res)}"):
                log(f"[{wl}] wrote {plot}")
    log(f"wrote {out}")
    if args.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
