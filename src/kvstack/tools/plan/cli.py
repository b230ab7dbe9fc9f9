"""The command line of ``kvstack plan`` (and ``python -m kvstack.tools.plan``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from kvstack.core.errors import ConfigError
from kvstack.tools.command import run_tool
from kvstack.tools.plan.operators import format_operator_plan, make_operator_plan
from kvstack.tools.plan.report import format_plan
from kvstack.tools.plan.sizing import make_plan
from kvstack.tools.plan.specs import DTYPE_BYTES, parse_tokens, resolve_gpu, resolve_model

PROG = "python -m kvstack.tools.plan"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvstack plan``."""
    p.add_argument("--model", help="registry name, HF id, or path to config.json")
    p.add_argument(
        "--gpu",
        help="GPU name or per-GPU memory such as 80GiB; a name's '80gb' means 80 GiB (80 × 2^30 B)",
    )
    p.add_argument("--context", help="tokens per request: 131072 or 128k (k=1024)")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=[*DTYPE_BYTES], help="default bf16")
    p.add_argument(
        "--weights-dtype", choices=[*DTYPE_BYTES], help="default: the checkpoint's dtype"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="(0, 1], default 0.9")
    p.add_argument(
        "--prefix-hit-rate",
        type=float,
        default=0.0,
        help="fraction of each request's tokens that is a shared cached prefix, in [0, 1)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block (default 16): requests hold whole blocks, and a sliding-"
        "window layer the blocks its next row can read, as the engine's paged cache does",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object with every figure")
    op = p.add_argument_group(
        "operator-level provisioning (OpScale) from a `kvstack profile` JSON, instead of "
        "--model/--gpu/--context"
    )
    op.add_argument("--profile", help="the JSON `kvstack profile` wrote")
    op.add_argument("--rate", type=float, help="target load, requests per second")
    op.add_argument("--prompt-tokens", type=int, help="prompt tokens per request")
    op.add_argument("--output-tokens", type=int, help="generated tokens per request")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``kvstack plan``; raises ConfigError on bad input, warnings go to stderr."""
    if args.profile is not None:
        return _run_operator_plan(args)
    missing = [f"--{n}" for n in ("model", "gpu", "context") if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} required (or --profile FILE with --rate ...)")
    plan = make_plan(
        resolve_model(args.model),
        resolve_gpu(args.gpu),
        parse_tokens(args.context),
        kv_cache_dtype=args.kv_cache_dtype,
        weights_dtype=args.weights_dtype,
        tp=args.tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_hit_rate=args.prefix_hit_rate,
        block_size=args.block_size,
    )
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0


def _run_operator_plan(args: argparse.Namespace) -> int:
    missing = [
        f"--{n.replace('_', '-')}"
        for n in ("rate", "prompt_tokens", "output_tokens")
        if getattr(args, n) is None
    ]
    if missing:
        raise ConfigError(f"--profile needs {', '.join(missing)}")
    plan = make_operator_plan(
        args.profile, args.rate, args.prompt_tokens, args.output_tokens, args.prefix_hit_rate
    )
    print(json.dumps(asdict(plan), indent=2) if args.json else format_operator_plan(plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstack.tools.plan ...``: the same as ``kvstack plan``."""
    return run_tool(
        PROG,
        add_plan_args,
        run_plan,
        argv,
        description="Capacity planner: KV bytes per token and per request, weight memory, "
        "KV budget, concurrent requests at a context, and an autoscaling threshold.",
    )
