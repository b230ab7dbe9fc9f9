"""``kvstack eval``: what each KV codec or press costs (``kvstack.tools.eval``)."""

from __future__ import annotations

import argparse

from kvstack.tools.eval import add_eval_args, run_eval_cli


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ev = sub.add_parser(
        "eval",
        help="what each KV codec costs: KL, top-1 and greedy agreement, needle, memory, speed",
        description="Run the model with and without KV codecs on the same inputs and report "
        "quality (teacher-forced KL and top-1 agreement, greedy agreement, passkey retrieval), "
        "KV memory per token and decode throughput.",
    )
    add_eval_args(ev)
    ev.set_defaults(func=run_eval_cli)
