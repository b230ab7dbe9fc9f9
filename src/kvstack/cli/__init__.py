"""The ``kvstack`` command: one module per subcommand, each with ``register(subparsers)``.

``generate`` and ``chat`` run the engine here; ``serve`` the HTTP server (or a Ray Serve
deployment); ``bench``, ``plan``, ``profile``, ``analyze``, ``eval``, ``router`` and
``deploy`` are the tools'; ``doctor`` reports the machine and install for a bug report.
The engine flags are derived from ``EngineConfig`` (``cli.engine_args``).

Any user error prints one line, ``kvstack: error: ...``, and exits with code 2. This is
the top layer: nothing else in kvstack imports ``kvstack.cli``.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence

import kvstack
from kvstack.cli import (
    analyze,
    bench,
    chat,
    deploy,
    doctor,
    generate,
    plan,
    profile,
    router,
    serve,
)
from kvstack.cli import eval as evaluate
from kvstack.cli.config_file import expand_config_file
from kvstack.core.errors import KvstackError

COMMANDS = (generate, chat, serve, bench, plan, profile, analyze, evaluate, router, deploy, doctor)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstack",
        description="kvstack: an LLM inference engine on a paged KV cache. Any command "
        "takes --config FILE.yaml (option names to values; flags given win).",
    )
    p.add_argument("--version", action="version", version=f"kvstack {kvstack.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    # No abbreviations: with vLLM's spellings next to kvstack's, a prefix could pick
    # either, and a misspelt flag must be an error, not another option.
    p.allow_abbrev = False
    for parser in sub.choices.values():
        parser.allow_abbrev = False
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = expand_config_file(parser, list(sys.argv[1:] if argv is None else argv))
    except KvstackError as e:
        print(f"kvstack: error: {e}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args.command, extra)
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


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> None:
    """argparse's usage error for arguments no flag takes, with the closest flag spelling
    (``--enable-prefix-cachin`` -> ``--enable-prefix-caching``); exits with status 2."""
    sub = next(
        a.choices[command]
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction) and command in a.choices
    )
    flags = [e.split("=")[0] for e in extra if e.startswith("-")]
    near = [m for f in flags for m in difflib.get_close_matches(f, sub._option_string_actions, 1)]
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    sub.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


__all__ = ["build_parser", "main"]
