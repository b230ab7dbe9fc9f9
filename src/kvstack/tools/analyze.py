"""``kvstack analyze LOGS.jsonl``: is my traffic cacheable?

Replays a request log through the engine's *own* prefix cache (``KVCacheManager`` with
the hash-chain cache and its LRU / LFU / adaptive eviction policies) at several cache
sizes and reports hit rates, the within- vs cross-session split, the most shared
prefixes and the knee of the hit-rate-vs-size curve. Inspired by kv-cache-analyzer and
vLLM's proposed ``analyze-prefix-cache`` tool.

The pieces: ``analyze_log`` reads the untrusted log (formats and safety limits),
``analyze_replay`` replays it through ``KVCacheManager`` (and the Belady ``oracle``
policy), this module runs the analysis and the CLI, and ``analyze_report`` formats the
report, finds the knee, plots and checks for regressions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.config import parse_size
from kvstack.errors import ConfigError, KvstackError
from kvstack.kv.hashing import BlockHash
from kvstack.tools.analyze_log import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    FORMATS,
    LogRequest,
    ParseResult,
    iter_lines,
    json_depth,
    parse_line,
    read_log,
)
from kvstack.tools.analyze_replay import (
    ALL_POLICIES,
    ENGINE_POLICIES,
    OraclePolicy,
    PolicyResult,
    _Prepared,
    prepare,
    replay,
)
from kvstack.tools.analyze_report import (
    check_cache_regression,
    find_knee,
    format_report,
    write_plot,
)

__all__ = [
    "ALL_POLICIES",
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "ENGINE_POLICIES",
    "FORMATS",
    "AnalyzeOptions",
    "LogRequest",
    "OraclePolicy",
    "ParseResult",
    "PolicyResult",
    "add_analyze_args",
    "analyze",
    "check_cache_regression",
    "find_knee",
    "iter_lines",
    "json_depth",
    "parse_line",
    "prepare",
    "read_log",
    "replay",
    "run_analyze",
]

KNEE_TOLERANCE = 0.02


# ---------------------------------------------------------------------------- analysis


def shared_prefixes(
    requests: Sequence[LogRequest], prep: _Prepared, block_size: int, top: int = 10
) -> list[dict[str, Any]]:
    """The longest block-aligned prefixes shared by >= 2 requests, most reused first.

    A prefix (a chain hash) is reported when at least two requests contain it and it is
    longer than every shared extension of it with the same frequency, i.e. no child
    prefix is contained in as many requests. Ranked by ``reuse_tokens`` = length x
    (frequency - 1), the prefill an infinite cache saves on it.
    """
    count: dict[BlockHash, int] = {}
    where: dict[BlockHash, tuple[int, int]] = {}  # first (request, block index)
    best_child: dict[BlockHash, int] = {}
    for i, hs in enumerate(prep.hashes):
        for b, h in enumerate(hs):
            count[h] = count.get(h, 0) + 1
            where.setdefault(h, (i, b))
    for hs in prep.hashes:
        for parent, child in itertools.pairwise(hs):
            if count[child] > best_child.get(parent, 0):
                best_child[parent] = count[child]
    out: list[dict[str, Any]] = []
    for h, c in count.items():
        if c >= 2 and best_child.get(h, 0) < c:
            i, b = where[h]
            length = (b + 1) * block_size
            out.append(
                {
                    "length_tokens": length,
                    "frequency": c,
                    "reuse_tokens": length * (c - 1),
                    "first_line": requests[i].line_no,
                    "head_token_ids": requests[i].token_ids[: min(length, 8)].tolist(),
                }
            )
    out.sort(key=lambda d: (-d["reuse_tokens"], -d["length_tokens"], d["first_line"]))
    return out[:top]


def ideal_hit_rate(requests: Sequence[LogRequest], prep: _Prepared, block_size: int) -> float:
    """Token hit rate of an infinite cache (every earlier full block is reusable)."""
    seen: set[BlockHash] = set()
    hits = total = 0
    for i, r in enumerate(requests):
        for h in prep.needs[i]:
            if h not in seen:
                break
            hits += block_size
        seen.update(prep.hashes[i])
        total += len(r.token_ids)
    return hits / total if total else 0.0


def auto_cache_sizes(requests: Sequence[LogRequest], prep: _Prepared, bs: int) -> list[int]:
    """Up to 8 geometric sizes (block multiples) from one that fits the largest request to
    one that holds every distinct block next to the largest request (an infinite cache)."""
    distinct = len({h for hs in prep.hashes for h in hs})
    largest = max((-(-len(r.token_ids) // bs) for r in requests), default=1)
    lo, hi = largest, max(distinct + largest, largest)
    n = 8
    ratio = (hi / lo) ** (1 / (n - 1))
    return sorted({round(lo * ratio**k) * bs for k in range(n)})


def model_kv_bytes_per_token(model: str | Path, dtype_bytes: int) -> int | None:
    """KV bytes per token of ``model`` from its config alone, or None if not loadable."""
    try:
        from kvstack.model.gguf import read_gguf_config
        from kvstack.model.registry import model_format, resolve_model_path
        from kvstack.model.safetensors import config_from_hf, read_hf_config

        path = resolve_model_path(model)
        if model_format(path) == "gguf":
            cfg = read_gguf_config(path)
        else:
            cfg = config_from_hf(read_hf_config(path), path)
        return cfg.kv_bytes_per_token(dtype_bytes)
    except (KvstackError, OSError, ValueError, KeyError):
        return None


@dataclass
class AnalyzeOptions:
    block_size: int = 16
    cache_sizes: list[int] | None = None  # tokens; None: auto
    policies: tuple[str, ...] = ALL_POLICIES
    model: str | None = None
    kv_dtype_bytes: int = 2
    progress: bool = False


def analyze(parsed: ParseResult, opts: AnalyzeOptions) -> dict[str, Any]:
    """The JSON report of a parsed log (see ``analyze_report.format_report``)."""
    bs = opts.block_size
    if bs < 1:
        raise ConfigError(f"block size must be >= 1, got {bs}")
    reqs = parsed.requests
    prep = prepare(reqs, bs)
    sizes = sorted(set(opts.cache_sizes)) if opts.cache_sizes else auto_cache_sizes(reqs, prep, bs)
    for s in sizes:
        if s < bs:
            raise ConfigError(f"cache size {s} tokens is smaller than one block ({bs} tokens)")
    bar = None
    tick: Callable[[], None] | None = None
    if opts.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(opts.policies) * len(sizes) * len(reqs), desc="replay", leave=False)
        tick = bar.update
    try:
        results = [
            replay(reqs, p, s, bs, prep, tick).to_json() for p in opts.policies for s in sizes
        ]
    finally:
        if bar is not None:
            bar.close()
    prompt_tokens = sum(len(r.token_ids) for r in reqs)
    knees = {}
    for p in opts.policies:
        curve = [(r["cache_size_tokens"], r["token_hit_rate"]) for r in results if r["policy"] == p]
        knees[p] = find_knee(curve, KNEE_TOLERANCE)
    prefixes = shared_prefixes(reqs, prep, bs)
    kvb = model_kv_bytes_per_token(opts.model, opts.kv_dtype_bytes) if opts.model else None
    if kvb is not None:
        for d in prefixes:
            d["kv_bytes"] = d["length_tokens"] * kvb
    cached = [r.num_cached_tokens for r in reqs]
    report: dict[str, Any] = {
        "version": 1,
        "block_size": bs,
        "num_requests": len(reqs),
        "num_prompt_tokens": prompt_tokens,
        "num_sessions": len({r.session_id for r in reqs if r.session_id is not None}),
        "num_lines": parsed.num_lines,
        "num_malformed_lines": parsed.num_malformed,
        "malformed_lines": [{"line": n, "error": e} for n, e in parsed.malformed],
        "ordered_by": parsed.ordered_by,
        "cache_sizes": sizes,
        "policies": list(opts.policies),
        "ideal_hit_rate": round(ideal_hit_rate(reqs, prep, bs), 6),
        "results": results,
        "knees": knees,
        "knee_tolerance": KNEE_TOLERANCE,
        "shared_prefixes": prefixes,
        "notes": [
            "the last prompt token is never reused (a hit covers at most (n-1)//block_size "
            "blocks), as in the engine",
            "a hit block is within-session when the first request that stored it has the "
            "same session id",
        ],
    }
    if kvb is not None:
        report["kv_bytes_per_token"] = kvb
    if reqs and all(c is not None for c in cached):
        report["observed_hit_rate"] = round(
            sum(c or 0 for c in cached) / prompt_tokens if prompt_tokens else 0.0, 6
        )
    return report


# ---------------------------------------------------------------------------- CLI


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
        help="comma list of lru, lfu, adaptive, oracle (Belady upper bound), none (default all)",
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
    parser = argparse.ArgumentParser(prog="kvstack analyze", description=__doc__.split("\n")[0])
    add_analyze_args(parser)
    try:
        return run_analyze(parser.parse_args(argv))
    except KvstackError as e:
        print(f"kvstack analyze: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
