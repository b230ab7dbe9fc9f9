"""``kvstack deploy``: render deployment manifests (``kvstack.deploy``)."""

from __future__ import annotations

import argparse

from kvstack.deploy.cli import add_deploy_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dp = sub.add_parser(
        "deploy",
        help="render deployment manifests (Kubernetes: engine, router, Redis, KEDA, PodMonitor)",
        description="Render the manifests that run kvstack on an existing platform.",
    )
    add_deploy_args(dp)  # its subcommands set their own func
