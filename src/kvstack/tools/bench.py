"""``kvstack bench serve``: an async benchmark client for any OpenAI-compatible server.

It sends a workload (:mod:`kvstack.tools.workloads`, or a JSONL file written by
:func:`~kvstack.tools.workloads.write_jsonl`) to kvstack, vLLM, SGLang or llama.cpp's
server and reports what ``vllm bench serve`` reports (vLLM's
``benchmarks/benchmark_serving.py`` is the model for the metrics, see
:mod:`kvstack.tools.bench_report`), plus the prefix-cache hit rate when the server
returns ``usage.prompt_tokens_details.cached_tokens``.

Every request streams (``stream: true``, ``stream_options.include_usage``): the client
timestamps each chunk with text, keeps the generated text and the usage, and records a
failure (HTTP status and message, an ``error`` event in the stream, a stream cut before
``[DONE]``/``finish_reason``, a timeout, a refused connection) instead of raising.

**Traffic.** Requests are released at Poisson arrival times of rate ``--request-rate``
(gamma gaps when ``--burstiness`` != 1, as vLLM; seeded by ``--seed``; ``inf`` releases
them all at once) in workload order (round, then arrival index), and at most
``--max-concurrency`` are in flight.

**Multi-turn** (``multi-turn``, ``agent-tools``): a request of round k of a session is sent
only after every request of rounds < k of the *same* session finished (failed ones
included); it waits for that after its release time and before taking a concurrency slot,
so other sessions keep going. Its prompt is the workload's (synthetic assistant turns),
not the server's replies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from kvstack.errors import ConfigError, KvstackError
from kvstack.tools.bench_report import (
    SLO_KEYS,
    BenchResult,
    RequestResult,
    calculate_metrics,
    format_report,
    plot_latencies,
)
from kvstack.tools.workloads import WORKLOADS, WorkloadRequest, _knob, make_workload, read_jsonl

__all__ = [
    "BenchConfig",
    "BenchResult",
    "RequestResult",
    "StreamAccumulator",
    "add_bench_serve_args",
    "arrival_offsets",
    "build_payload",
    "parse_sse_line",
    "run_bench_serve",
    "run_benchmark",
    "run_schedule",
    "session_dependencies",
]

DONE = "[DONE]"


# ---------------------------------------------------------------- SSE stream parsing


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """The JSON object of an SSE ``data:`` line, :data:`DONE` for ``data: [DONE]``, None
    for any other line (blank, ``: comment``, ``event:``, ``id:``). Raises ``ValueError``
    for a ``data:`` line that is not a JSON object."""
    line = line.rstrip("\r\n")
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == DONE:
        return DONE
    obj = json.loads(payload)  # json.JSONDecodeError is a ValueError
    if not isinstance(obj, dict):
        raise ValueError(f"SSE data is not a JSON object: {payload[:80]!r}")
    return obj


def _error_message(obj: Any) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``)."""
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj))
        if isinstance(err, dict):
            return str(err.get("message") or err.get("msg") or err)
        return str(err)
    return str(obj)


@dataclass
class StreamAccumulator:
    """Folds the bytes of one streamed response into text, chunk times, usage and errors.

    ``feed(data, now)`` takes bytes as they arrive (lines may be split anywhere) and the
    time they arrived; each ``data:`` line with non-empty ``choices[0].delta.content``
    (chat; also ``reasoning_content``/``reasoning``) or ``choices[0].text`` (completions)
    adds a chunk time. The last ``usage`` object seen wins. Malformed lines are counted
    and skipped.
    """

    texts: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str = ""
    done: bool = False  # data: [DONE] seen
    finished: bool = False  # a finish_reason seen
    malformed: int = 0
    _buffer: bytes = b""

    def feed(self, data: bytes, now: float) -> None:
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        for raw in lines:
            self._line(raw, now)

    def close(self, now: float) -> None:
        """End of the body: parse a last line without its newline."""
        if self._buffer:
            raw, self._buffer = self._buffer, b""
            self._line(raw, now)

    def _line(self, raw: bytes, now: float) -> None:
        if self.done:
            return
        try:
            event = parse_sse_line(raw.decode("utf-8", errors="replace"))
        except ValueError:
            self.malformed += 1
            return
        if event is None:
            return
        if isinstance(event, str):
            self.done = True
            return
        if event.get("error"):
            self.error = self.error or f"stream error: {_error_message(event)}"
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                text = (
                    delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                )
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self.texts.append(text)
                self.chunk_times.append(now)
            if choice.get("finish_reason"):
                self.finished = True

    def fill(self, result: RequestResult, start: float) -> None:
        """Set ``result``'s text, TTFT, ITLs and usage fields (times relative to ``start``)."""
        times = self.chunk_times
        result.generated_text = "".join(self.texts)
        result.num_chunks = len(times)
        result.ttft = times[0] - start if times else None
        result.itl = [b - a for a, b in itertools.pairwise(times)]
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")

        def count(value: Any) -> int | None:
            is_int = isinstance(value, int) and not isinstance(value, bool)
            return value if is_int else None

        result.prompt_tokens = count(usage.get("prompt_tokens"))
        result.completion_tokens = count(usage.get("completion_tokens"))
        if isinstance(details, dict):
            result.cached_tokens = count(details.get("cached_tokens"))


# ---------------------------------------------------------------- one request


def build_payload(
    req: WorkloadRequest,
    endpoint: str,
    model: str,
    *,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The streaming request body: ``messages`` for chat (a raw prompt becomes one user
    message), the prompt *text* for completions; ``ignore_eos`` only when set."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(
        max_tokens=req.max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    req: WorkloadRequest,
    timeout: float,
) -> RequestResult:
    """Send one streaming request; never raises (except cancellation)."""
    res = RequestResult(req.request_id, req.session_id, req.round, len(req.prompt_token_ids))
    acc = StreamAccumulator()
    start = time.perf_counter()
    try:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        async with session.post(url, json=payload, headers=headers, timeout=client_timeout) as r:
            res.status = r.status
            if r.status != 200:
                body = await r.text()
                try:
                    message = _error_message(json.loads(body))
                except ValueError:
                    message = body.strip()
                res.error = f"HTTP {r.status}: {message[:500] or r.reason}"
            else:
                async for data in r.content.iter_any():
                    acc.feed(data, time.perf_counter())
                    if acc.done:
                        break
                acc.close(time.perf_counter())
                if acc.error:
                    res.error = acc.error
                elif not (acc.done or acc.finished):
                    res.error = "stream ended before [DONE] or a finish_reason"
                else:
                    res.success = True
    except TimeoutError:
        res.error = f"timeout after {timeout:g} s"
    except aiohttp.ClientError as e:
        res.error = f"{type(e).__name__}: {e}"
    except Exception as e:  # a benchmark client must survive anything a server does
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    acc.fill(res, start)
    return res


# ---------------------------------------------------------------- traffic


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Release times (s from the start) of ``n`` requests: the first at 0, then gaps drawn
    from a gamma distribution of mean ``1 / rate`` and shape ``burstiness`` (1 = Poisson
    process; < 1 burstier), as vLLM; all 0 when ``rate`` is inf."""
    if rate <= 0 or burstiness <= 0:
        raise ConfigError("request rate and burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


def order_requests(requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """Workload order: by round, then arrival index (stable)."""
    return sorted(requests, key=lambda r: (r.round, r.arrival_index))


def session_dependencies(requests: Sequence[WorkloadRequest]) -> list[list[int]]:
    """For each request, the indices of the requests of the same session and an earlier
    round: those that must finish before it is sent (none without a session)."""
    by_session: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        if r.session_id is not None:
            by_session[r.session_id].append(i)
    deps: list[list[int]] = []
    for r in requests:
        same = by_session.get(r.session_id, []) if r.session_id is not None else []
        deps.append([j for j in same if requests[j].round < r.round])
    return deps


async def run_schedule(
    requests: Sequence[WorkloadRequest],
    send: Callable[[WorkloadRequest], Awaitable[RequestResult]],
    offsets: Sequence[float],
    max_concurrency: int | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run ``send`` on every request at its offset, after its session dependencies, with at
    most ``max_concurrency`` in flight. Returns the results in request order (``start_time``
    set to when ``send`` was called, from the start) and the duration in seconds."""
    if len(offsets) != len(requests):
        raise ValueError("one offset per request")
    deps = session_dependencies(requests)
    finished = [asyncio.Event() for _ in requests]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        req = requests[i]
        try:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            for j in deps[i]:
                await finished[j].wait()
            async with sem if sem is not None else contextlib.nullcontext():
                sent = time.perf_counter()
                try:
                    res = await send(req)
                except Exception as e:  # send should not raise; never lose a request
                    res = RequestResult(req.request_id, req.session_id, req.round)
                    res.prompt_len = len(req.prompt_token_ids)
                    res.latency, res.error = time.perf_counter() - sent, f"{type(e).__name__}: {e}"
        finally:
            finished[i].set()
        res.start_time = sent - t0
        if on_done is not None:
            on_done(res)
        return res

    results = await asyncio.gather(*(one(i) for i in range(len(requests))))
    return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------- the benchmark


@dataclass
class BenchConfig:
    """What :func:`run_benchmark` needs (see :func:`add_bench_serve_args` for meanings)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"
    model: str | None = None
    api_key: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout: float = 600.0
    disable_tqdm: bool = True


def normalize_base_url(url: str) -> str:
    """``http://host:port`` without a trailing ``/`` or ``/v1``."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--base-url must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_model(session: aiohttp.ClientSession, base_url: str, cfg: BenchConfig) -> str:
    """The first model id of ``GET {base_url}/v1/models`` (``ConfigError`` if none)."""
    url = f"{base_url}/v1/models"
    try:
        timeout = aiohttp.ClientTimeout(total=min(cfg.timeout, 30.0))
        async with session.get(url, headers=_headers(cfg.api_key), timeout=timeout) as r:
            body = await r.text()
            if r.status != 200:
                raise ConfigError(f"GET {url}: HTTP {r.status}: {body.strip()[:300]}")
            data = json.loads(body).get("data") or []
            return str(data[0]["id"])
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ConfigError(f"GET {url} failed ({type(e).__name__}: {e}); is the server up?") from e
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ConfigError(f"GET {url}: no model id in the answer; pass --model") from e


async def run_benchmark(
    requests: Sequence[WorkloadRequest], cfg: BenchConfig
) -> tuple[list[RequestResult], float, str]:
    """Send ``requests`` (in :func:`order_requests` order) as ``cfg`` says; returns the
    results in that order, the duration in seconds and the model name used."""
    from tqdm import tqdm

    base = normalize_base_url(cfg.base_url)
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    reqs = order_requests(requests)
    offsets = arrival_offsets(len(reqs), cfg.request_rate, cfg.burstiness, cfg.seed)
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        model = cfg.model or await fetch_model(session, base, cfg)
        headers = _headers(cfg.api_key)

        def send(req: WorkloadRequest) -> Awaitable[RequestResult]:
            payload = build_payload(
                req,
                cfg.endpoint,
                model,
                temperature=cfg.temperature,
                ignore_eos=cfg.ignore_eos,
                extra_body=cfg.extra_body,
            )
            return send_request(session, base + path, payload, headers, req, cfg.timeout)

        with tqdm(total=len(reqs), disable=cfg.disable_tqdm, desc="requests") as bar:
            results, duration = await run_schedule(
                reqs, send, offsets, cfg.max_concurrency, lambda _: bar.update(1)
            )
    return results, duration, model


# ---------------------------------------------------------------- CLI


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


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    """Add the options of ``kvstack bench serve`` to ``p``."""
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
        type=_knob,
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="workload knob, e.g. --set shared_prefix_len=1000 (repeatable; see workloads)",
    )
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
    from kvstack.model.registry import load_tokenizer

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
    1 when none did; raises :class:`~kvstack.errors.KvstackError` (the CLI prints it and
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
    requests, workload = load_requests(args)
    label = args.label or cfg.base_url
    rate_text = "inf" if math.isinf(rate) else f"{rate:g}"
    print(
        f"Benchmark: {len(requests)} requests of {workload!r} to {label} "
        f"({cfg.endpoint} endpoint), request rate {rate_text}/s, burstiness "
        f"{cfg.burstiness:g}, max concurrency {cfg.max_concurrency or 'unlimited'}",
        flush=True,
    )
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    results, duration, model = asyncio.run(run_benchmark(requests, cfg))
    slos = dict(args.goodput or [])
    metrics: BenchResult = calculate_metrics(results, duration, args.percentiles, slos)
    configured: list[tuple[str, object]] = [("Server:", label), ("Model:", model)]
    configured += [("Workload:", workload), ("Request rate configured (RPS):", rate_text)]
    if cfg.max_concurrency:
        configured.append(("Maximum request concurrency:", cfg.max_concurrency))
    print(format_report(metrics, configured), flush=True)

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
            "num_prompts": len(requests),
            "request_rate": rate_text if math.isinf(rate) else rate,
            "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency,
            "settings": _settings(args),
            **metrics.to_json(),
        }
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
    p = argparse.ArgumentParser(
        prog="python -m kvstack.tools.bench",
        description="Benchmark an OpenAI-compatible server (like vllm bench serve).",
    )
    add_bench_serve_args(p)
    args = p.parse_args(argv)
    try:
        return run_bench_serve(args)
    except KvstackError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
