"""The HTTP side of ``kvstack bench serve``: one streaming request, and the whole run.

Every request streams (``stream: true``, ``stream_options.include_usage``): the client
timestamps each chunk with text (:mod:`.stream`), keeps the generated text and the usage,
and records a failure (HTTP status and message, an ``error`` event in the stream, a stream
cut before ``[DONE]``/``finish_reason``, a timeout, a refused connection) instead of
raising. :func:`run_benchmark` (the API for scripts) sends a workload on the schedule of
:mod:`.traffic`. Multi-turn prompts are the workload's (synthetic assistant turns), not
the server's replies (but agent-loop's live sessions, :mod:`.agent`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvstack.core.errors import ConfigError
from kvstack.tools.bench.report import RequestResult
from kvstack.tools.bench.stream import StreamAccumulator, error_message
from kvstack.tools.bench.traffic import arrival_offsets, order_requests, run_schedule
from kvstack.tools.workloads.spec import WorkloadRequest


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
    message), the prompt *text* for completions; ``ignore_eos`` only when set; then the
    request's ``body_extra`` (agent-loop: ``tools``, ``tool_choice``), then ``extra_body``."""
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
    body.update(req.body_extra or {})
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
    """Send one streaming request; never raises (except cancellation). A request with
    ``tools`` times TTFT and ITLs on every chunk (:meth:`StreamAccumulator.fill`)."""
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
                    message = error_message(json.loads(body))
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
    acc.fill(res, start, every_chunk=bool(payload.get("tools")))
    return res


@dataclass
class BenchConfig:
    """What :func:`run_benchmark` needs (the options of ``kvstack bench serve``, :mod:`.cli`)."""

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


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_model(session: aiohttp.ClientSession, base_url: str, cfg: BenchConfig) -> str:
    """The first model id of ``GET {base_url}/v1/models`` (``ConfigError`` if none)."""
    url = f"{base_url}/v1/models"
    try:
        timeout = aiohttp.ClientTimeout(total=min(cfg.timeout, 30.0))
        async with session.get(url, headers=auth_headers(cfg.api_key), timeout=timeout) as r:
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
        headers = auth_headers(cfg.api_key)

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
