"""``kvstack router``: the KV-aware OpenAI front over replicas (``kvstack.route.router``)."""

from __future__ import annotations

import argparse

from kvstack.route.router.cli import add_router_args, run_router


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rt = sub.add_parser(
        "router",
        help="KV-aware OpenAI front over `kvstack serve` replicas (picks a replica, proxies)",
        description="Route each OpenAI request to one of several `kvstack serve` replicas by "
        "a KV-aware policy (round_robin, least_load, prefix, kv_events) and proxy it, with "
        "health checks, one retry before the first byte, and prefill/decode sequencing. It "
        "never places, scales or restarts replicas: Kubernetes, Ray or you do.",
    )
    add_router_args(rt)
    rt.set_defaults(func=run_router)
