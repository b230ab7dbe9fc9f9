"""``kvstack serve``: the OpenAI-compatible server on 127.0.0.1:8000 by default.

Its flags are derived from three declarations: ``ServerOptions`` (``kvstack.serve.server``),
``RayOptions`` (``kvstack.route.ray``) and ``EngineConfig``. The command turns them into
those frozen objects and hands them on: to ``serve`` in this process, or with ``--ray``
to a Ray Serve deployment whose replicas receive the same objects.
"""

from __future__ import annotations

import argparse

from kvstack.cli.engine_args import add_engine_args
from kvstack.cli.vllm_flags import add_vllm_flags, apply_vllm_flags
from kvstack.config.engine import EngineConfig
from kvstack.core.errors import ConfigError
from kvstack.core.options import add_arguments
from kvstack.route.ray import RayOptions
from kvstack.serve.server import ServerOptions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "serve",
        usage="%(prog)s [MODEL] [options]  (kvstack serve -h lists them)",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve the model over HTTP with the OpenAI API and Prometheus metrics.",
    )
    s.add_argument(
        "model_tag", nargs="?", metavar="MODEL",
        help="the model, as vLLM's positional `vllm serve MODEL` (same as --model)",
    )  # fmt: skip
    add_arguments(s, ServerOptions)
    add_arguments(s, RayOptions)
    add_engine_args(s)
    add_vllm_flags(s)  # every other `vllm serve` flag: accepted, mapped or refused
    s.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    if a.model_tag is not None:
        if a.model not in ("default", a.model_tag):
            raise ConfigError(f"two models: {a.model_tag!r} and --model {a.model!r}")
        a.model = a.model_tag
    apply_vllm_flags(a)
    server = ServerOptions.from_cli_args(a)
    engine = EngineConfig.from_cli_args(a)
    server.check(engine)
    ray = RayOptions.from_cli_args(a)
    if ray.ray:
        from kvstack.route.ray.app import serve_on_ray

        return serve_on_ray(engine, server, ray)
    from kvstack.serve.server import serve

    return serve(engine, server)
