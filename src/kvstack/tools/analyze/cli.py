"""The command line of ``kvstack analyze`` (and ``python -m kvstack.tools.analyze``).

Options (:func:`add_analyze_args`) and the run (:func:`run_analyze`: read the log, analyze,
print the report, write the JSON and the plot, compare with a baseline report).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError
from kvstack.core.units import parse_size
from kvstack.tools.analyze.analysis import AnalyzeOptions, analyze
from kvstack.tools.analyze.log import FORMATS, read_log
from kvstack.tools.analyze.replay import ALL_POLICIES, ENGINE_POLICIES
from kvstack.tools.analyze.report import check_cache_regression, format_report, write_plot
from kvstack.tools.command import run_tool

PROG = "python -m kvstack.tools.analyze"


def _sizes(text: str) -> list[int]:
    try:
        out = [int(parse_size(t.strip())) for t in text.split(",") if t.strip()]
    except ConfigError as e:
        raise argparse.ArgumentTypeError(f"bad cache size list {text!r}: {e}") from None
    if not out:
        raise argparse.ArgumentTypeError("empty cache size list")
    return out


def _policies(text: str) -> tuple[str, ...]:
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in out if p not in ALL_POLICIES]
    if bad or not out:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad) or text!r}; choose from: {', '.join(ALL_POLICIES)}"
        )
    return out


def add_analyze_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstack analyze``."""
    parser.add_argument("log", help="request log, one JSON object per line")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="tokens",
        help="openai: request bodies (or {timestamp, session_id, body}); kvstack: the server's "
        "--request-log; tokens: {timestamp, prompt_token_ids, session_id} (default)",
    )
    parser.add_argument("--model", default=None, help="model name or path (tokenizer, KV size)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer source (default: --model)")
    parser.add_argument(
        "--cache-size",
        type=_sizes,
        default=None,
        help="cache sizes in tokens, comma separated (default: doubling sizes up to all blocks)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="KV block size in tokens, as the engine's"
    )
    parser.add_argument(
        "--session-field",
        default="session_id",
        help="field naming the conversation, to split within- vs cross-session hits",
    )
    parser.add_argument(
        "--policy",
        type=_policies,
        default=ALL_POLICIES,
        help=f"comma list of {', '.join(ENGINE_POLICIES)}, oracle (Belady upper bound), none "
        "(default all)",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="KV dtype for the memory cost of shared prefixes (default bfloat16)",
    )
    parser.add_argument("--output-json", default=None, help="write the report as JSON")
    parser.add_argument("--plot", default=None, help="write a hit-rate-vs-size PNG")
    parser.add_argument("--baseline", default=None, help="earlier report.json to compare to")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.02,
        help="with --baseline: exit 1 if a hit rate drops by more than this (default 0.02)",
    )
    parser.add_argument(
        "--max-file-bytes", default="512MB", help="refuse larger logs (default 512MB)"
    )
    parser.add_argument("--max-line-bytes", default="8MiB", help="longer lines are malformed")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad line")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _load_baseline(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"cannot read baseline report {path!r}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ConfigError(f"{path!r} is not a kvstack analyze report (no 'results' list)")
    return data


def run_analyze(args: argparse.Namespace) -> int:
    """Run ``kvstack analyze``; 0 on success, 1 on a hit-rate regression vs ``--baseline``.

    User errors raise ``ConfigError`` (the CLI prints one line and exits 2).
    """
    baseline = _load_baseline(args.baseline) if args.baseline else None
    if args.tolerance < 0:
        raise ConfigError(f"--tolerance must be >= 0, got {args.tolerance}")
    progress = not args.quiet
    parsed = read_log(
        args.log,
        args.format,
        session_field=args.session_field,
        tokenizer=args.tokenizer or args.model,
        max_file_bytes=parse_size(args.max_file_bytes),
        max_line_bytes=parse_size(args.max_line_bytes),
        strict=args.strict,
        progress=progress,
    )
    if parsed.num_malformed:
        print(
            f"warning: {parsed.num_malformed} malformed line(s) skipped"
            + "".join(f"\n  line {n}: {e}" for n, e in parsed.malformed),
            file=sys.stderr,
        )
    if not parsed.requests:
        raise ConfigError(f"no valid requests in {args.log!r}")
    opts = AnalyzeOptions(
        block_size=args.block_size,
        cache_sizes=args.cache_size,
        policies=tuple(args.policy),
        model=args.model,
        kv_dtype_bytes=4 if args.kv_dtype == "float32" else 2,
        progress=progress,
    )
    report = analyze(parsed, opts)
    report["log"] = str(args.log)
    report["format"] = args.format
    print(format_report(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        write_plot(report, args.plot)
    if baseline is not None:
        if baseline.get("block_size") not in (None, report["block_size"]):
            print(
                f"warning: baseline block size {baseline.get('block_size')} != "
                f"{report['block_size']}; hit rates are not directly comparable",
                file=sys.stderr,
            )
        regressions = check_cache_regression(report, baseline, args.tolerance)
        for line in regressions:
            print(f"regression: {line}", file=sys.stderr)
        if regressions:
            return 1
        print(f"no hit-rate regression vs {args.baseline} (tolerance {args.tolerance})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstack.tools.analyze LOG ...``: the same as ``kvstack analyze``."""
    return run_tool(
        PROG,
        add_analyze_args,
        run_analyze,
        argv,
        description="Is my traffic cacheable? Replay a request log through kvstack's prefix "
        "cache at several sizes.",
    )
