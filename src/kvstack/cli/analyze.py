"""``kvstack analyze``: replay a request log through the prefix cache (tools.analyze)."""

from __future__ import annotations

import argparse

from kvstack.tools.analyze import add_analyze_args, run_analyze


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    an = sub.add_parser(
        "analyze",
        help="replay a request log through the prefix cache: hit rate per policy and size",
        description="Is my traffic cacheable? Replays a request log through kvstack's own block "
        "hashing and eviction policies (plus a Belady oracle) at several cache sizes.",
    )
    add_analyze_args(an)
    an.set_defaults(func=run_analyze)
