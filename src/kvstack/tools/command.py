"""The ``main`` of every ``python -m kvstack.tools.<tool>``: parse, run, map errors to exit codes.

Exit codes are ``kvstack``'s: the tool's own (0, or 1 for a failed check), 2 for a user
error (a ``KvstackError``, printed as one ``PROG: error: ...`` line, or a bad argument),
130 on Ctrl-C, 0 when the reader of a pipe left (``... | head``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvstack.core.errors import KvstackError


def run_tool(
    prog: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
    **parser_kwargs: Any,
) -> int:
    """Build the parser ``add_args`` fills, parse ``argv`` (default ``sys.argv``), ``run`` it."""
    parser = argparse.ArgumentParser(prog=prog, **parser_kwargs)
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        return int(run(args))
    except KvstackError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
