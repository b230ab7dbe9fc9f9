"""``kvstack bench serve``: statistics, SSE parsing, arrivals and multi-turn ordering (no
model, no server; the client end to end is in ``test_bench_end_to_end.py``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench_serve_util import parse, wreq
from kvstack.core.errors import ConfigError
from kvstack.tools.bench import (
    DONE,
    StreamAccumulator,
    arrival_offsets,
    build_payload,
    normalize_base_url,
    order_requests,
    parse_sse_line,
    run_schedule,
    session_dependencies,
)
from kvstack.tools.bench.report import (
    RequestResult,
    calculate_metrics,
    format_report,
    latency_stats,
    meets_slos,
    peak_concurrency,
    plot_latencies,
)
from kvstack.tools.workloads import WorkloadRequest


def rres(ttft: float, latency: float, out: int, **kw: Any) -> RequestResult:
    return RequestResult(success=True, ttft=ttft, latency=latency, completion_tokens=out, **kw)


# ---------------------------------------------------------------- statistics


def test_request_result_tpot_and_lengths() -> None:
    r = rres(0.1, 0.5, 5, prompt_len=7)
    assert r.tpot == pytest.approx(0.1)
    assert (r.output_len, r.input_len) == (5, 7)
    r.prompt_tokens = 9
    assert r.input_len == 9
    one = rres(0.1, 0.1, 1)
    assert one.tpot is None
    chunks = RequestResult(success=True, ttft=0.1, latency=0.4, num_chunks=4)
    assert chunks.output_len == 4 and chunks.tpot == pytest.approx(0.1)
    assert RequestResult(success=True, ttft=None, latency=0.4, num_chunks=0).tpot is None


def test_latency_stats_percentiles() -> None:
    values = [0.001 * v for v in range(1, 101)]  # 1..100 ms
    s = latency_stats(values, [50, 90, 99, 99.9])
    assert s["mean"] == pytest.approx(50.5)
    assert s["median"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(np.percentile(np.arange(1, 101), 90))
    assert s["p99"] == pytest.approx(99.01)
    assert s["p99.9"] == pytest.approx(np.percentile(np.arange(1, 101), 99.9))
    assert s["std"] == pytest.approx(np.std(np.arange(1, 101)))
    assert latency_stats([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_peak_concurrency() -> None:
    assert peak_concurrency([]) == 0
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # touching: not overlapping
    assert peak_concurrency([(0, 3), (0.5, 2), (1, 1.5), (2.5, 4)]) == 3


def test_calculate_metrics_and_goodput() -> None:
    rs = [
        rres(0.1, 0.5, 5, prompt_len=10, itl=[0.1, 0.1, 0.1, 0.1], start_time=0.0),
        rres(0.2, 1.0, 9, prompt_len=20, itl=[0.1] * 8, start_time=0.5, cached_tokens=16),
        rres(0.3, 0.3, 1, prompt_len=30, start_time=1.0, prompt_tokens=32, cached_tokens=0),
        RequestResult("bad", prompt_len=40, start_time=0.2, latency=0.1, error="HTTP 500: x"),
    ]
    m = calculate_metrics(rs, duration=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 10 + 20 + 32
    assert m.total_output == 5 + 9 + 1
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(7.5)
    assert m.total_token_throughput == pytest.approx((62 + 15) / 2)
    assert m.max_concurrency_observed == 2  # r0 [0, .5), bad [.2, .3), r1 [.5, 1.5), r2 [1, 1.3]
    assert m.cached_tokens == 16
    assert m.cache_hit_rate == pytest.approx(16 / (20 + 32))
    assert m.latency_ms["ttft"]["mean"] == pytest.approx(200.0)
    assert m.latency_ms["tpot"]["mean"] == pytest.approx(100.0)  # r2 (1 token) excluded
    assert m.latency_ms["itl"]["median"] == pytest.approx(100.0)
    assert m.latency_ms["e2el"]["p99"] == pytest.approx(np.percentile([500, 1000, 300], 99))
    assert m.goodput is None and m.errors == [("bad", "HTTP 500: x")]

    slo = calculate_metrics(rs, 2.0, [99], {"ttft": 150.0})
    assert slo.good_completed == 1 and slo.goodput == pytest.approx(0.5)
    slo = calculate_metrics(rs, 2.0, [99], {"tpot": 100.0, "e2el": 600.0})
    assert slo.good_completed == 2  # r0 (tpot 100, e2el 500) and r2 (tpot 0, e2el 300)
    assert not meets_slos(RequestResult(success=True, ttft=None, latency=0.1), {"ttft": 1e9})
    assert meets_slos(RequestResult(success=True, ttft=None, latency=0.1), {"e2el": 100.0})

    js = json.loads(json.dumps(slo.to_json()))
    assert js["p99_ttft_ms"] == pytest.approx(slo.latency_ms["ttft"]["p99"])
    assert js["output_lens"] == [5, 9, 1, 0] and js["errors"][3] == "HTTP 500: x"
    assert js["ttfts"][3] is None and js["itls"][3] == [] and js["request_goodput"] == 1.0

    text = format_report(m, [("Server:", "fake")])
    assert text.splitlines()[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    for line in ("Successful requests:", "Failed requests:", "P99 TTFT (ms):", "Median ITL"):
        assert line in text
    assert "P50" not in text and "Prefix cache hit rate (%):" in text and "bad: HTTP 500" in text


def test_report_prints_first_five_errors() -> None:
    rs = [RequestResult(f"e{i}", error=f"boom {i}") for i in range(7)]
    text = format_report(calculate_metrics(rs, 1.0))
    assert "Errors (first 5 of 7):" in text and "boom 4" in text and "boom 5" not in text
    assert "Cached prompt tokens" not in text and "goodput" not in text


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rs = [rres(0.01 * i, 0.1 + 0.01 * i, 5, itl=[0.02] * 4) for i in range(1, 20)]
    rs[0].itl = [0.02, 0.02 + 1e-12]  # a tiny non-zero range must not break the histogram
    path = tmp_path / "lat.png"
    plot_latencies(calculate_metrics(rs, 1.0), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- SSE


def chunk(content: str | None = None, **extra: Any) -> str:
    choice: dict[str, Any] = {"index": 0, "delta": {} if content is None else {"content": content}}
    return "data: " + json.dumps({"choices": [choice], **extra}) + "\n\n"


RECORDED = (
    chunk("")  # role chunk with empty content: not a token
    + ": keep-alive comment\n\n"
    + "event: message\n"
    + chunk("Hé")
    + "data: {not json\n\n"
    + "data: [1, 2]\n\n"
    + chunk(" là")
    + chunk("!")
    + 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
    + 'data: {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, '
    + '"total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 8}}}\r\n\r\n'
    + "data: [DONE]\n\n"
    + chunk("after done")
)


def test_parse_sse_line() -> None:
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line('data:{"a": 1}\r\n') == {"a": 1}
    assert parse_sse_line(": ping") is None and parse_sse_line("") is None
    assert parse_sse_line("event: x") is None
    with pytest.raises(ValueError):
        parse_sse_line("data: {oops")
    with pytest.raises(ValueError):
        parse_sse_line("data: 3")


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_stream_accumulator_any_split(piece: int) -> None:
    data = RECORDED.encode()
    acc = StreamAccumulator()
    for k in range(0, len(data), piece):  # arbitrary splits, even inside "é"
        acc.feed(data[k : k + piece], now=float(k))
    acc.close(now=1e9)
    assert acc.done and acc.finished and not acc.error
    assert acc.malformed == 2
    assert "".join(acc.texts) == "Hé là!"
    res = RequestResult(success=True, latency=50.0)
    acc.fill(res, start=0.0)
    assert res.generated_text == "Hé là!" and res.num_chunks == 3 and len(res.itl) == 2
    assert (res.prompt_tokens, res.completion_tokens, res.cached_tokens) == (12, 3, 8)


def test_stream_accumulator_times() -> None:
    """Chunk k of the recording arrives at time k: TTFT and ITLs come from text chunks."""
    acc = StreamAccumulator()
    blocks = [b + "\n\n" for b in RECORDED.split("\n\n") if b]
    for k, block in enumerate(blocks):
        acc.feed(block.encode(), now=10.0 + k)
    res = RequestResult(success=True, latency=20.0)
    acc.fill(res, start=10.0)
    # blocks: 0 role, 1 comment, 2 event+Hé, 3 {not json, 4 [1, 2], 5 là, 6 !, 7 finish, ...
    assert res.ttft == 2.0 and res.itl == [3.0, 1.0]
    assert res.tpot == pytest.approx((20.0 - 2.0) / 2)


def test_stream_accumulator_completions_and_errors() -> None:
    acc = StreamAccumulator()
    acc.feed(b'data: {"choices": [{"index": 0, "text": "a"}]}\n', 1.0)
    acc.feed(b'data: {"choices": [{"index": 1, "text": "other choice"}]}\n', 1.5)
    acc.feed(b'data: {"error": {"message": "engine died", "code": 500}}\n', 2.0)
    acc.feed(b'data: {"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]}', 3.0)
    acc.close(4.0)  # the last line had no newline
    assert acc.texts == ["a", "b"] and acc.chunk_times == [1.0, 4.0] and acc.finished
    assert acc.error == "stream error: engine died" and not acc.done


def test_build_payload() -> None:
    r = wreq(0, "hi")
    chat = build_payload(r, "chat", "m", extra_body={"top_k": 5})
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert (chat["ignore_eos"], chat["max_tokens"], chat["top_k"], chat["model"]) == (
        True,
        4,
        5,
        "m",
    )
    comp = build_payload(r, "completions", "m", ignore_eos=False, temperature=0.5)
    assert comp["prompt"] == "<user>hi" and "messages" not in comp and "ignore_eos" not in comp
    raw = WorkloadRequest("x", [1], None, "raw text", 3, None, 0, 0)
    assert build_payload(raw, "chat", "m")["messages"] == [{"role": "user", "content": "raw text"}]
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(ConfigError):
        normalize_base_url("h:1")


def test_args() -> None:
    a = parse([])
    assert a.base_url == "http://127.0.0.1:8000" and a.endpoint == "chat"
    assert math.isinf(a.request_rate) and a.ignore_eos and a.percentiles == [50, 90, 99]
    assert a.num_prompts is None and a.max_tokens is None and a.goodput == []
    a = parse(["--goodput", "ttft:500", "e2el:2e3", "--percentiles", "99,95", "--no-ignore-eos"])
    assert dict(a.goodput) == {"ttft": 500.0, "e2el": 2000.0}
    assert a.percentiles == [95.0, 99.0] and not a.ignore_eos
    assert parse(["--request-rate", "2.5"]).request_rate == 2.5
    for bad in (["--goodput", "foo:1"], ["--request-rate", "0"], ["--percentiles", "101"]):
        with pytest.raises(SystemExit):
            parse(bad)


# ---------------------------------------------------------------- traffic


def test_arrival_offsets() -> None:
    a = arrival_offsets(20_000, rate=4.0, seed=3)
    assert a == arrival_offsets(20_000, rate=4.0, seed=3)
    assert a != arrival_offsets(20_000, rate=4.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    gaps = np.diff(a)
    assert (len(a) - 1) / a[-1] == pytest.approx(4.0, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(20_000, rate=4.0, burstiness=0.5, seed=3))
    assert np.mean(bursty) == pytest.approx(0.25, rel=0.05)
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(math.sqrt(2), rel=0.05)
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError):
        arrival_offsets(3, 0.0)


def multi_turn(sessions: int, turns: int) -> list[WorkloadRequest]:
    """Round-major like the real workloads; session s's turns take longer for odd s."""
    out = []
    for k in range(turns):
        for s in range(sessions):
            out.append(wreq(len(out), f"s{s} t{k}", f"conv-{s}", k))
    return out


def test_session_dependencies() -> None:
    reqs = [*multi_turn(2, 3), wreq(6, "alone"), wreq(7, "group", "g", 0), wreq(8, "g2", "g", 0)]
    deps = session_dependencies(reqs)
    assert deps[:2] == [[], []]
    assert deps[2] == [0] and deps[3] == [1]  # round 1
    assert deps[4] == [0, 2] and deps[5] == [1, 3]  # round 2
    assert deps[6:] == [[], [], []]
    shuffled = [reqs[i] for i in (5, 0, 3, 1, 4, 2)]
    assert [r.request_id for r in order_requests(shuffled)] == [f"r{i}" for i in range(6)]


@dataclass
class FakeSend:
    """Records when each request ran; odd sessions are slow."""

    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    in_flight: int = 0
    peak: int = 0

    async def __call__(self, req: WorkloadRequest) -> RequestResult:
        start = time.perf_counter()
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        slow = req.session_id is not None and int(req.session_id[-1]) % 2
        await asyncio.sleep(0.05 if slow else 0.005)
        self.in_flight -= 1
        self.spans[req.request_id] = (start, time.perf_counter())
        if req.request_id == "r3":
            raise RuntimeError("send blew up")
        return RequestResult(req.request_id, req.session_id, req.round, success=True, ttft=0.0)


@pytest.mark.parametrize("max_concurrency", [None, 2])
def test_run_schedule_orders_rounds_per_session(max_concurrency: int | None) -> None:
    reqs = multi_turn(4, 3)
    send = FakeSend()
    done: list[str] = []
    results, duration = asyncio.run(
        run_schedule(
            reqs, send, [0.0] * len(reqs), max_concurrency, lambda r: done.append(r.request_id)
        )
    )
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    assert sorted(done) == sorted(r.request_id for r in reqs)
    deps = session_dependencies(reqs)
    for i, r in enumerate(reqs):
        for j in deps[i]:
            assert send.spans[r.request_id][0] >= send.spans[reqs[j].request_id][1]
    assert results[3].error == "RuntimeError: send blew up" and not results[3].success
    assert sum(r.success for r in results) == len(reqs) - 1
    if max_concurrency is None:
        # no round barrier: fast conv-0 ends turn 2 before slow conv-1 ends turn 1
        assert send.spans["r8"][1] < send.spans["r5"][1]
        assert send.peak == 4
    else:
        assert send.peak <= max_concurrency
    assert duration > 0 and all(r.start_time >= 0 for r in results)


def test_run_schedule_respects_offsets() -> None:
    reqs = [wreq(i) for i in range(3)]
    send = FakeSend()
    results, _ = asyncio.run(run_schedule(reqs, send, [0.0, 0.05, 0.1]))
    starts = [r.start_time for r in results]
    assert starts[1] >= 0.05 and starts[2] >= 0.1
