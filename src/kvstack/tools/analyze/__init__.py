"""``kvstack analyze LOGS.jsonl``: is my traffic cacheable?

Replays a request log through the engine's *own* prefix cache (``KVCacheManager`` with
the hash-chain cache and its LRU / LFU / adaptive eviction policies) at several cache
sizes and reports hit rates, the within- vs cross-session split, the most shared
prefixes and the knee of the hit-rate-vs-size curve. Inspired by kv-cache-analyzer and
vLLM's proposed ``analyze-prefix-cache`` tool.

The modules, in data order: ``log`` reads the untrusted log (formats and safety limits),
``replay`` replays it through ``KVCacheManager`` (and the Belady ``oracle`` policy),
``analysis`` runs every replay and builds the JSON report, ``report`` formats it, finds
the knee, plots and checks for regressions, ``cli`` is the command line.
"""

from kvstack.tools.analyze.analysis import AnalyzeOptions, analyze
from kvstack.tools.analyze.cli import add_analyze_args, main, run_analyze
from kvstack.tools.analyze.log import (
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
from kvstack.tools.analyze.replay import (
    ALL_POLICIES,
    ENGINE_POLICIES,
    OraclePolicy,
    PolicyResult,
    prepare,
    replay,
)
from kvstack.tools.analyze.report import check_cache_regression, find_knee

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
    "main",
    "parse_line",
    "prepare",
    "read_log",
    "replay",
    "run_analyze",
]
