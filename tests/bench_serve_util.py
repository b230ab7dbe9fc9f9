"""Shared pieces of the ``kvstack bench serve`` tests: workload requests and the
command line parsed as ``kvstack bench serve`` parses it."""

from __future__ import annotations

import argparse

from kvstack.tools.bench.cli import add_bench_serve_args
from kvstack.tools.workloads import WorkloadRequest


def wreq(
    i: int, text: str = "hello", session: str | None = None, rnd: int = 0, max_tokens: int = 4
) -> WorkloadRequest:
    msgs = [{"role": "user", "content": text}]
    return WorkloadRequest(f"r{i}", [1] * 10, msgs, f"<user>{text}", max_tokens, session, rnd, i)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    return p.parse_args(argv)
