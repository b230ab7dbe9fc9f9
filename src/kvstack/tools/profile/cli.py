"""The command line of ``kvstack profile`` (and ``python -m kvstack.tools.profile``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.config.choices import quantizations, to_dtype
from kvstack.core.errors import ConfigError
from kvstack.kv.codecs import KV_CACHE_DTYPES
from kvstack.tools.command import run_tool
from kvstack.tools.profile.bounds import measure_bounds
from kvstack.tools.profile.report import build_report, format_table, plot_roofline
from kvstack.tools.profile.run import Workload, check_context, run_workload

PROG = "python -m kvstack.tools.profile"
BLOCK_SIZE = 16
DESCRIPTION = (
    "Operator-level profile (OpScale-style): for a model, batch, context and KV codec, "
    "per-operator time, FLOPs, bytes, arithmetic intensity and achieved fraction of this "
    "machine's measured roofline, for prefill and decode apart; a table, JSON (which "
    "`kvstack plan --profile` reads) and a roofline PNG."
)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvstack profile``."""
    p.add_argument("--model", default="default", help="'default', a .gguf file or an HF folder")
    p.add_argument("--batch", type=int, default=8, help="requests prefilled and decoded together")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV codec (default auto)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        type=to_dtype,  # 'auto' resolved from the CPU's ISA, as the engine's --dtype
        choices=["auto", "bfloat16", "float32"],
        help="default auto: bfloat16 with AVX512-BF16 or AMX, else float32",
    )
    p.add_argument(
        "--quantization",
        default="none",
        choices=list(quantizations()),
        help="weights kept quantized (as `kvstack serve --quantization`): the linears' bytes "
        "are their packed bytes; the compute bound stays the bf16 GEMM's (default none)",
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps measured (default 8)")
    p.add_argument(
        "--kv-cache-memory",
        help="KV budget such as 2GiB; default: exactly what batch x context needs",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="prefill chunk budget per step"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default="profile.json", help="where to write the JSON")
    p.add_argument("--png", default="profile.png", help="where to write the roofline plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def _engine_options(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "max_num_seqs": max(w.batch, 1),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
        "block_size": BLOCK_SIZE,
    }
    if args.kv_cache_memory:
        opts["kv_cache_memory"] = args.kv_cache_memory
    else:  # what the workload needs (one extra block per request for the warm-up)
        opts["num_blocks"] = w.batch * (-(-w.tokens_per_request // BLOCK_SIZE) + 1) + 4
    return opts


def run_profile(args: argparse.Namespace) -> int:
    """Run ``kvstack profile``: ConfigError (exit 2) for input it cannot run."""
    for name in ("batch", "context", "steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}")
    from tqdm import tqdm

    from kvstack.engine.llm import LLM
    from kvstack.model.loader.registry import read_model_config

    w = Workload(args.batch, args.context, steps=args.steps, seed=args.seed)
    # Before the engine sizes its KV cache for batch x context (which a context far
    # beyond the model's would fail to allocate): the model's metadata alone.
    check_context(w, read_model_config(args.model).max_position_embeddings)
    llm = LLM(args.model, **_engine_options(args, w))
    engine = llm.engine
    bars = {
        "prefill": tqdm(total=w.batch * w.context, desc="prefill", unit="tok",
                        disable=args.no_progress),
        "decode": tqdm(total=w.batch * w.steps, desc="decode", unit="tok",
                       disable=args.no_progress),
    }  # fmt: skip
    try:
        phases = run_workload(engine, w, tick=lambda ph, n: bars[ph].update(n))
    finally:
        for bar in bars.values():
            bar.close()
    if not args.no_progress:
        print("measuring bandwidth and GEMM throughput...", file=sys.stderr)
    bounds = measure_bounds(engine.model, (w.batch,))
    kv = engine.kv_storage
    per_token = kv.bytes_per_block(
        engine.model.config, kv.block_size, kv.dtype, args.kv_cache_dtype
    )
    report = build_report(
        args.model, args.dtype, args.kv_cache_dtype, w, phases, bounds, per_token / kv.block_size
    )
    report["quantization"] = args.quantization
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    plot_roofline(report, Path(args.png))
    print(format_table(report))
    print(f"wrote {args.json} and {args.png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstack.tools.profile ...``: the same as ``kvstack profile``."""
    return run_tool(PROG, add_profile_args, run_profile, argv, description=DESCRIPTION)
