"""``python -m kvstack.tools.workloads NAME``: build a workload, write it, print its summary."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from kvstack.tools.command import run_tool
from kvstack.tools.workloads.builders import make_workload
from kvstack.tools.workloads.jsonl import write_jsonl
from kvstack.tools.workloads.spec import DEFAULTS, WORKLOADS, parse_knob
from kvstack.tools.workloads.stats import summarize

PROG = "python -m kvstack.tools.workloads"


def add_workloads_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m kvstack.tools.workloads``."""
    p.add_argument("name", choices=WORKLOADS, help="workload to build")
    p.add_argument("--num-requests", type=int, default=32, help="requests in all (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of all generated text (default 0)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)"
    )
    p.add_argument("--out", default=None, help="write the requests to this JSONL file")
    p.add_argument(
        "--tokenizer",
        default="default",
        help="model name or path whose tokenizer to use (default: the default model)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="block size of ideal_hit_rate (default 16)"
    )
    p.add_argument(
        "--set",
        dest="knobs",
        type=parse_knob,
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="override a WorkloadSpec knob, e.g. --set shared_prefix_len=1000 (repeatable)",
    )


def run_workloads(args: argparse.Namespace) -> int:
    """Build the workload, write it with ``--out``, print its summary as JSON; 0."""
    from kvstack.model.loader.registry import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    reqs = make_workload(
        args.name, tok, args.num_requests, args.seed, args.max_tokens, **dict(args.knobs)
    )
    if args.out:
        write_jsonl(reqs, args.out)
    print(json.dumps({"workload": args.name, **summarize(reqs, args.block_size)}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Build a workload from ``argv``; exit code 2 (one error line) for a bad knob."""
    unset = {"num_groups": "ceil(n/32)", "num_sessions": "from n", "num_tool_sets": "sessions"}
    knobs = "\n".join(
        f"  {name}: " + ", ".join(f"{k}={unset[k] if v is None else v}" for k, v in d.items())
        for name, d in DEFAULTS.items()
    )
    return run_tool(
        PROG,
        add_workloads_args,
        run_workloads,
        argv,
        description="Build a deterministic synthetic workload and print its summary as JSON.",
        epilog=f"knobs (--set KNOB=VALUE; see WorkloadSpec) and their defaults:\n{knobs}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
