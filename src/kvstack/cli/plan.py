"""``kvstack plan``: the capacity planner (``kvstack.tools.plan``)."""

from __future__ import annotations

import argparse

from kvstack.tools.plan import add_plan_args, run_plan


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pl = sub.add_parser(
        "plan",
        help="KV memory per token / request and how many requests fit on a GPU",
        description="Capacity planner: KV bytes per token and per request, weight memory, "
        "KV budget, concurrent requests at a context, and an autoscaling threshold.",
    )
    add_plan_args(pl)
    pl.set_defaults(func=run_plan)
