"""``kvstack profile``: operator-level profile and roofline (``kvstack.tools.profile``)."""

from __future__ import annotations

import argparse

from kvstack.tools.profile import add_profile_args, run_profile
from kvstack.tools.profile.cli import DESCRIPTION


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pr = sub.add_parser(
        "profile",
        help="per-operator time, FLOPs, bytes and roofline of prefill and decode",
        description=DESCRIPTION,
    )
    add_profile_args(pr)
    pr.set_defaults(func=run_profile)
