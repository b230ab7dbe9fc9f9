"""The ``kvstack deploy`` command: one sub-command per target (only ``k8s`` for now).

:func:`add_deploy_args` adds the targets to the ``deploy`` parser and sets ``func`` to
:func:`run_deploy`; the options of a target are its ``*_cli`` module's
(:mod:`kvstack.deploy.k8s_cli`), the rendering its own module's (:mod:`kvstack.deploy.k8s`).
"""

from __future__ import annotations

import argparse
import sys

from kvstack.core.errors import ConfigError
from kvstack.deploy.k8s import render_yaml, write_files
from kvstack.deploy.k8s_cli import add_k8s_args, options_from_args


def add_deploy_args(p: argparse.ArgumentParser) -> None:
    """Sub-commands of ``kvstack deploy`` (only ``k8s`` for now); each sets ``func``."""
    sub = p.add_subparsers(dest="deploy_target", required=True, metavar="TARGET")
    k = sub.add_parser(
        "k8s",
        help="render Kubernetes manifests (engine, Redis KV tier, router, KEDA, PodMonitor)",
        description="Print kvstack's Kubernetes manifests as YAML (or write one file per "
        "component). Kubernetes owns placement, scaling and restarts; the router only picks "
        "a replica per request.",
    )
    add_k8s_args(k)
    k.set_defaults(func=run_deploy)


def run_deploy(args: argparse.Namespace) -> int:
    """Run ``kvstack deploy k8s``: YAML to stdout, or files into ``--output-dir``."""
    if getattr(args, "deploy_target", "k8s") != "k8s":
        raise ConfigError(f"unknown deploy target {args.deploy_target!r}; choose from: k8s")
    opts = options_from_args(args)
    if args.output_dir is None:
        sys.stdout.write(render_yaml(opts))
        return 0
    paths = write_files(opts, args.output_dir)
    print(f"wrote {', '.join(p.name for p in paths)} to {args.output_dir}", file=sys.stderr)
    return 0
