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

The command line (options, workload loading, report and result file) is
:mod:`kvstack.tools.bench_cli`; :func:`run_benchmark` is the API for scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvstack.errors import ConfigError
from kvstack.tools.bench_report import BenchResult, RequestResult
from kvstack.tools.workloads import WorkloadRequest

__all__ = [
    "BenchConfig",
    "BenchResult",
    "RequestResult",
    "StreamAccumulator",
    "arrival_offsets",
    "build_payload",
    "parse_sse_line",
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


if __name__ == "__main__":  # python -m kvstack.tools.bench: the command line's main
    from kvstack.tools.bench_cli import main

    sys.exit(main())
