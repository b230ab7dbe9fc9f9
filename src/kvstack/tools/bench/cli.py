"""The command line of ``kvstack bench serve`` (and ``python -m kvstack.tools.bench``).

Options (:func:`add_bench_serve_args`), the workload they select (:func:`load_requests`) and
the run itself (:func:`run_bench_serve`: send, report, save the JSON result and the plot).
The client is :mod:`.client` (streaming :mod:`.stream`, schedule :mod:`.traffic`); the
statistics and report are :mod:`.report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError
from kvstack.tools.bench.agent import AgentRun, run_agent_loop
from kvstack.tools.bench.agent_report import format_agent_report
from kvstack.tools.bench.client import BenchConfig, normalize_base_url, run_benchmark
from kvstack.tools.bench.report import (
    SLO_KEYS,
    BenchResult,
    RequestResult,
    calculate_metrics,
    format_report,
    plot_latencies,
)
from kvstack.tools.bench.spec_decode import (
    fetch_spec_counters,
    format_spec_decode,
    spec_decode_summary,
)
from kvstack.tools.bench.traffic import arrival_offsets, order_requests
from kvstack.tools.command import run_tool
from kvstack.tools.workloads.builders import make_spec, make_workload
from kvstack.tools.workloads.jsonl import read_jsonl
from kvstack.tools.workloads.spec import WORKLOADS, WorkloadRequest, WorkloadSpec, parse_knob

PROG = "python -m kvstack.tools.bench"

__all__ = [
    "add_bench_serve_args",
    "load_requests",
    "main",
    "parse_json_object",
    "parse_percentiles",
    "parse_rate",
    "parse_slo",
    "run_bench_serve",
]


def parse_rate(text: str) -> float:
    """``"inf"`` or a positive number of requests per second."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text!r}")
    return rate


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``, each in (0, 100]."""
    try:
        values = sorted({float(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of percentiles: {text!r}") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100]: {text!r}")
    return values


def parse_slo(text: str) -> tuple[str, float]:
    """``"ttft:500"`` -> ``("ttft", 500.0)`` (milliseconds)."""
    key, sep, value = text.partition(":")
    key = key.strip().lower()
    if not sep or key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(f"expected ttft:MS, tpot:MS or e2el:MS, got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: not a number of ms: {value!r}") from None
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"{key}: SLO must be >= 0 ms, got {value!r}")
    return key, ms


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return obj


def _server_args(p: argparse.ArgumentParser) -> None:
    """The server: URL, endpoint, model, key, timeout."""
    s = p.add_argument_group("server")
    s.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root URL (default http://127.0.0.1:8000; a trailing /v1 is accepted)",
    )
    s.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="'chat': /v1/chat/completions with messages (default); "
        "'completions': /v1/completions with the prompt text (chat template applied)",
    )
    s.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    s.add_argument("--label", default=None, help="name of the server in the results")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")


def _workload_args(p: argparse.ArgumentParser) -> None:
    """The workload: a synthetic one (``--workload``, ``--set``) or a file (``--dataset``)."""
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload", choices=WORKLOADS, default="random", help="synthetic workload (random)"
    )
    w.add_argument(
        "--dataset",
        default=None,
        metavar="FILE.jsonl",
        help="send this workload file (python -m kvstack.tools.workloads --out) instead",
    )
    w.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests (default 32; with --dataset: all, or its first N in round order)",
    )
    w.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens per request (default 64; with --dataset: the file's unless given)",
    )
    w.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    w.add_argument(
        "--tokenizer", default=None, help="tokenizer of the workload (default: default model)"
    )
    w.add_argument(
        "--set",
        dest="workload_knobs",
        type=parse_knob,
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="workload knob, e.g. --set shared_prefix_len=1000 (repeatable; see workloads)",
    )


def _traffic_args(p: argparse.ArgumentParser) -> None:
    """Arrivals, concurrency and sampling."""
    t = p.add_argument_group("traffic and sampling")
    t.add_argument(
        "--request-rate",
        type=parse_rate,
        default=math.inf,
        help="requests/s of Poisson arrivals, or inf to send all at once (default inf)",
    )
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson (default), < 1 burstier",
    )
    t.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    t.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos: true so outputs have max_tokens tokens (default on)",
    )
    t.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    t.add_argument(
        "--extra-body",
        type=parse_json_object,
        default={},
        metavar="JSON",
        help="fields merged into every request body, e.g. '{\"top_k\": 20}'",
    )


def _result_args(p: argparse.ArgumentParser) -> None:
    """Goodput SLOs, percentiles, the JSON result and the plot."""
    o = p.add_argument_group("results")
    o.add_argument(
        "--goodput",
        nargs="+",
        type=parse_slo,
        default=[],
        metavar="KEY:MS",
        help="SLOs, e.g. ttft:500 tpot:50 e2el:5000; goodput = req/s meeting all of them",
    )
    o.add_argument(
        "--percentiles",
        type=parse_percentiles,
        default=[50.0, 90.0, 99.0],
        metavar="P,P",
        help="latency percentiles to report (default 50,90,99; mean and median always)",
    )
    o.add_argument("--save-result", action="store_true", help="write the results as JSON")
    o.add_argument("--result-dir", default=".", help="folder of the JSON result (default .)")
    o.add_argument(
        "--result-filename",
        default=None,
        help="default bench-serve-<workload>-<rate>-<date>.json",
    )
    o.add_argument("--plot", default=None, metavar="PATH.png", help="latency histograms/CDFs")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    """Add the options of ``kvstack bench serve`` to ``p``."""
    for add_group in (_server_args, _workload_args, _traffic_args, _result_args):
        add_group(p)


def load_requests(args: argparse.Namespace) -> tuple[list[WorkloadRequest], str]:
    """The requests to send and the workload's name (the dataset's stem for a file)."""
    n = args.num_prompts
    if n is not None and n < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {n}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.dataset:
        try:
            reqs = order_requests(read_jsonl(args.dataset))
        except (OSError, ValueError, TypeError) as e:
            raise ConfigError(f"cannot read workload file {args.dataset}: {e}") from e
        if not reqs:
            raise ConfigError(f"workload file {args.dataset} has no requests")
        reqs = reqs[:n] if n is not None else reqs
        if args.max_tokens is not None:
            reqs = [replace(r, max_tokens=args.max_tokens) for r in reqs]
        return reqs, Path(args.dataset).stem
    from kvstack.model.loader.registry import load_tokenizer

    tok = load_tokenizer(args.tokenizer or "default")
    reqs = make_workload(
        args.workload,
        tok,
        n if n is not None else 32,
        seed=args.seed,
        max_tokens=args.max_tokens if args.max_tokens is not None else 64,
        **dict(args.workload_knobs or []),
    )
    return reqs, args.workload


def agent_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The resolved agent-loop spec of the options (sessions from --num-prompts unless
    ``--set num_sessions=N``, not both)."""
    knobs = dict(args.workload_knobs or [])
    if args.num_prompts is not None and "num_sessions" in knobs:
        raise ConfigError("give --num-prompts or --set num_sessions, not both")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    n, max_tokens = args.num_prompts or 32, args.max_tokens or 64
    return make_spec("agent-loop", n, args.seed, max_tokens, **knobs)


def _send(
    args: argparse.Namespace, cfg: BenchConfig, label: str, rate_text: str
) -> tuple[list[RequestResult], float, str, str, AgentRun | None]:
    """Send the workload: (results, duration, model, workload name, the agent run)."""
    where = (
        f"to {label} ({cfg.endpoint} endpoint), request rate {rate_text}/s, burstiness "
        f"{cfg.burstiness:g}, max concurrency {cfg.max_concurrency or 'unlimited'}"
    )
    if args.workload == "agent-loop" and not args.dataset:
        from kvstack.model.loader.registry import load_tokenizer

        spec = agent_spec(args)
        tok = load_tokenizer(args.tokenizer or "default")
        turns = f"{spec.num_turns} turns of {'named' if spec.named_tool_choice else 'required'}"
        print(f"Benchmark: agent-loop sessions ({turns} tool calls) {where}", flush=True)
        run = asyncio.run(run_agent_loop(spec, cfg, tok))
        return run.results, run.duration, run.model, "agent-loop", run
    requests, workload = load_requests(args)
    print(f"Benchmark: {len(requests)} requests of {workload!r} {where}", flush=True)
    results, duration, model = asyncio.run(run_benchmark(requests, cfg))
    return results, duration, model, workload, None


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options as JSON values (no API key, no callables)."""
    out: dict[str, Any] = {}
    for key, value in sorted(vars(args).items()):
        if key == "api_key" or callable(value):
            continue
        if isinstance(value, float) and math.isinf(value):
            value = "inf"
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
        out[key] = value
    return out


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run ``kvstack bench serve`` with parsed ``args``. Returns 0 when a request succeeded,
    1 when none did; raises :class:`~kvstack.core.errors.KvstackError` (the CLI prints it and
    exits 2) for a bad option or workload file, or when ``/v1/models`` cannot be read."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}")
    rate = float(args.request_rate)
    cfg = BenchConfig(
        base_url=normalize_base_url(args.base_url),
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        request_rate=rate,
        burstiness=args.burstiness,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=dict(args.extra_body or {}),
        timeout=args.timeout,
        disable_tqdm=args.disable_tqdm,
    )
    arrival_offsets(0, rate, cfg.burstiness)  # validate before building the workload
    label = args.label or cfg.base_url
    rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    spec_before = fetch_spec_counters(cfg.base_url, cfg.api_key)  # vLLM's spec_decode_*
    results, duration, model, workload, agent = _send(args, cfg, label, rate_text)
    spec = spec_decode_summary(spec_before, fetch_spec_counters(cfg.base_url, cfg.api_key))
    slos = dict(args.goodput or [])
    metrics: BenchResult = calculate_metrics(results, duration, args.percentiles, slos)
    configured: list[tuple[str, object]] = [("Server:", label), ("Model:", model)]
    configured += [("Workload:", workload), ("Request rate configured (RPS):", rate_text)]
    if cfg.max_concurrency:
        configured.append(("Maximum request concurrency:", cfg.max_concurrency))
    print(format_report(metrics, configured), flush=True)
    if spec is not None:
        print(format_spec_decode(spec), flush=True)
    if agent is not None:
        print(format_agent_report(agent.summary), flush=True)

    if args.save_result:
        result = {
            "date": date,
            "label": label,
            "base_url": cfg.base_url,
            "endpoint": cfg.endpoint,
            "model_id": model,
            "tokenizer_id": args.tokenizer or ("default" if not args.dataset else None),
            "workload": workload,
            "dataset": args.dataset,
            "num_prompts": len(results),
            "request_rate": rate_text if math.isinf(rate) else rate,
            "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency,
            "settings": _settings(args),
            **metrics.to_json(),
            **(spec or {}),
        }
        if agent is not None:
            result["agent"] = agent.summary.to_json()
            result["agent_steps"] = [asdict(s) for s in agent.steps]
            result["tool_calls"] = [r.tool_calls for r in results]
        name = args.result_filename or f"bench-serve-{workload}-{rate_text}-{date}.json"
        path = Path(args.result_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"Saved the result to {path}")
    if args.plot:
        try:
            plot_latencies(metrics, args.plot, f"{label}: {workload}, rate {rate_text}/s")
            print(f"Saved the plot to {args.plot}")
        except ImportError:
            print("cannot plot: matplotlib is not installed", file=sys.stderr)
    return 0 if metrics.completed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstack.tools.bench ...``: the same as ``kvstack bench serve``."""
    return run_tool(
        PROG,
        add_bench_serve_args,
        run_bench_serve,
        argv,
        description="Benchmark an OpenAI-compatible server (like vllm bench serve).",
    )
