"""The ``kvstack`` command: one module per subcommand, each with ``register(subparsers)``.

``generate`` and ``chat`` run the engine here; ``serve`` the HTTP server (or a Ray Serve
deployment); ``bench``, ``plan``, ``analyze``, ``eval``, ``router`` and ``deploy`` are the
tools'. The engine flags are derived from ``EngineConfig`` (``cli.engine_args``).

Any user error prints one line, ``kvstack: error: ...``, and exits with code 2. This is
the top layer: nothing else in kvstack imports ``kvstack.cli``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvstack.cli import analyze, bench, chat, deploy, generate, plan, router, serve
from kvstack.cli import eval as evaluate
from kvstack.errors import KvstackError

COMMANDS = (generate, chat, serve, bench, plan, analyze, evaluate, router, deploy)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstack",
        description="kvstack: an LLM inference engine on a paged KV cache.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except KvstackError as e:
        print(f"kvstack: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvstack plan ... | head`: the reader left; not an error
        sys.stderr.close()
        return 0


__all__ = ["build_parser", "main"]
