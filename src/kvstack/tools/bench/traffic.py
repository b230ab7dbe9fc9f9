"""When ``kvstack bench serve`` sends each request: arrivals, session order, concurrency.

Requests are released at Poisson arrival times of rate ``request_rate`` (gamma gaps when
``burstiness`` != 1, as vLLM; seeded; ``inf`` releases them all at once) in workload order
(round, then arrival index), and at most ``max_concurrency`` are in flight. A request of
round k of a session is sent only after every request of rounds < k of the *same*
session finished (failed ones included); it waits for that after its release time and
before taking a concurrency slot, so other sessions keep going.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence

from kvstack.core.errors import ConfigError
from kvstack.tools.bench.report import RequestResult
from kvstack.tools.workloads.spec import WorkloadRequest


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
