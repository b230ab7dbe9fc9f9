"""``kvstack bench serve``: the benchmark client (``kvstack.tools.bench``)."""

from __future__ import annotations

import argparse

from kvstack.tools.bench import add_bench_serve_args, run_bench_serve


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("bench", help="benchmarks against a running server")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser(
        "serve",
        help="load an OpenAI-compatible server with a workload and report latencies",
        description="Async benchmark client for any OpenAI-compatible server (like vllm bench "
        "serve): TTFT, TPOT, ITL, E2E latency and throughput.",
    )
    add_bench_serve_args(bs)
    bs.set_defaults(func=run_bench_serve)
