"""Statistics, report and plot of ``kvstack bench serve`` (the client is :mod:`.client`).

Everything here is a pure function of :class:`RequestResult` records, so it is tested
without a server. The metric definitions are those of vLLM's
``benchmarks/benchmark_serving.py`` (now ``vllm bench serve``, ``vllm/benchmarks/serve.py``),
so the numbers of both tools can be compared:

- **TTFT** (time to first token): from sending the request to the first streamed chunk
  whose text is not empty.
- **ITL** (inter-token latency): the gaps between consecutive non-empty chunks of one
  request; the statistics pool the gaps of all requests.
- **TPOT** (time per output token, first excluded): ``(E2EL - TTFT) / (output_tokens - 1)``
  per request with more than one output token.
- **E2EL** (end-to-end latency): from sending the request to the end of its stream.
- **Output tokens**: ``usage.completion_tokens`` when the server reports it, else the
  number of non-empty chunks.
- **Goodput**: completed requests per second that met every given SLO (milliseconds,
  inclusive). A single-token output has TPOT 0 there, as in vLLM; a request that streamed
  no text has no TTFT and misses a TTFT SLO.
- Statistics are in milliseconds; percentiles are numpy's (linear interpolation); the
  statistics of an empty set are 0. Failed requests count in no latency statistic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

METRICS: tuple[tuple[str, str, str], ...] = (
    # key, short name, section title (vLLM's)
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
SLO_KEYS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds.

    ``start_time`` is relative to the start of the benchmark once the runner returns.
    """

    request_id: str = ""
    session_id: str | None = None
    round: int = 0
    prompt_len: int = 0  # the workload's prompt tokens (the client's count)
    success: bool = False
    start_time: float = 0.0
    ttft: float | None = None  # None: no text was streamed
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    generated_text: str = ""
    num_chunks: int = 0  # streamed chunks with non-empty text
    prompt_tokens: int | None = None  # from usage, when reported
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    status: int | None = None  # HTTP status, None if no response
    error: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # streamed tool_calls
    finish_reason: str | None = None

    @property
    def output_len(self) -> int:
        """Output tokens: the server's count if given, else the non-empty chunks."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    @property
    def input_len(self) -> int:
        """Prompt tokens: the server's count if given, else the workload's."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def tpot(self) -> float | None:
        """``(E2EL - TTFT) / (output_len - 1)``; None unless there are 2+ output tokens."""
        if self.ttft is None or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def end_time(self) -> float:
        return self.start_time + self.latency


@dataclass
class BenchResult:
    """Aggregate metrics of one run (see the module docstring for the definitions)."""

    completed: int
    failed: int
    duration: float  # s, first send to last completion
    total_input: int  # prompt tokens of the completed requests
    total_output: int
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    total_token_throughput: float  # (input + output) tok/s
    max_concurrency_observed: int
    cached_tokens: int | None  # None: the server reported no cached_tokens
    cache_hit_rate: float | None  # cached / prompt tokens of the requests reporting it
    goodput: float | None  # req/s meeting every SLO; None without SLOs
    good_completed: int | None
    slos_ms: dict[str, float]
    percentiles: list[float]
    latency_ms: dict[str, dict[str, float]]  # "ttft" -> {"mean", "median", "std", "p99"...}
    requests: list[RequestResult]

    @property
    def errors(self) -> list[tuple[str, str]]:
        """``(request_id, message)`` of every failed request, in order."""
        return [(r.request_id, r.error) for r in self.requests if not r.success]

    def to_json(self) -> dict[str, Any]:
        """vLLM-style flat keys (``mean_ttft_ms``, ``p99_itl_ms``...) plus per-request
        arrays aligned with the requests (times in seconds; failed requests have output
        length 0, TTFT None, no ITLs and their error message)."""
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "cached_prompt_tokens": self.cached_tokens,
            "cache_hit_rate": self.cache_hit_rate,
            "request_throughput": self.request_throughput,
            "request_goodput": self.goodput,
            "goodput_slos_ms": self.slos_ms or None,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_concurrency_observed": self.max_concurrency_observed,
            "percentiles": self.percentiles,
        }
        for key, _, _ in METRICS:
            for stat, value in self.latency_ms[key].items():
                out[f"{stat}_{key}_ms"] = value
        rs = self.requests
        ok = [r.success for r in rs]
        out.update(
            request_ids=[r.request_id for r in rs],
            session_ids=[r.session_id for r in rs],
            rounds=[r.round for r in rs],
            start_times=[r.start_time for r in rs],
            input_lens=[r.input_len for r in rs],
            output_lens=[r.output_len if s else 0 for r, s in zip(rs, ok, strict=True)],
            cached_tokens=[r.cached_tokens for r in rs],
            ttfts=[r.ttft if s else None for r, s in zip(rs, ok, strict=True)],
            tpots=[r.tpot if s else None for r, s in zip(rs, ok, strict=True)],
            itls=[r.itl if s else [] for r, s in zip(rs, ok, strict=True)],
            e2els=[r.latency for r in rs],
            statuses=[r.status for r in rs],
            generated_texts=[r.generated_text for r in rs],
            errors=[r.error for r in rs],
        )
        return out


def percentile_key(p: float) -> str:
    """``99`` -> ``"p99"``, ``99.9`` -> ``"p99.9"`` (vLLM's key names)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def latency_stats(values_s: Iterable[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean, median, std and the percentiles of ``values_s`` (seconds), in milliseconds."""
    arr = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    keys = ["mean", "median", "std", *(percentile_key(p) for p in percentiles)]
    if arr.size == 0:
        return dict.fromkeys(keys, 0.0)
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        stats[percentile_key(p)] = float(np.percentile(arr, p))
    return stats


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals ``(start, end)`` open at once; one ending as another starts: no overlap."""
    events = sorted(e for s, t in intervals for e in ((s, 1), (t, -1)))  # -1 sorts first
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def meets_slos(r: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """Whether a completed request met every SLO (ms) in ``slos_ms`` (keys ``SLO_KEYS``)."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    for key, limit in slos_ms.items():
        value = values[key]
        if value is None or value * 1000.0 > limit:
            return False
    return True


def calculate_metrics(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (99.0,),
    slos_ms: Mapping[str, float] | None = None,
) -> BenchResult:
    """Aggregate ``results`` of a run that lasted ``duration`` seconds."""
    done = [r for r in results if r.success]
    total_in = sum(r.input_len for r in done)
    total_out = sum(r.output_len for r in done)
    cached = [r for r in done if r.cached_tokens is not None]
    cached_total = sum(r.cached_tokens or 0 for r in cached) if cached else None
    cached_base = sum(r.input_len for r in cached)
    hit_rate = cached_total / cached_base if cached_total is not None and cached_base else None
    per_s = 1.0 / duration if duration > 0 else 0.0
    series: dict[str, list[float]] = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    good = sum(meets_slos(r, slos_ms) for r in results) if slos_ms else None
    return BenchResult(
        completed=len(done),
        failed=len(results) - len(done),
        duration=duration,
        total_input=total_in,
        total_output=total_out,
        request_throughput=len(done) * per_s,
        output_throughput=total_out * per_s,
        total_token_throughput=(total_in + total_out) * per_s,
        max_concurrency_observed=peak_concurrency((r.start_time, r.end_time) for r in results),
        cached_tokens=cached_total,
        cache_hit_rate=hit_rate,
        goodput=None if good is None else good * per_s,
        good_completed=good,
        slos_ms=dict(slos_ms or {}),
        percentiles=[float(p) for p in percentiles],
        latency_ms={key: latency_stats(series[key], percentiles) for key, _, _ in METRICS},
        requests=list(results),
    )


def _line(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}".rstrip()


def format_report(
    result: BenchResult,
    configured: Sequence[tuple[str, object]] = (),
    max_errors: int = 5,
) -> str:
    """The text block of ``vllm bench serve`` (``configured``: extra lines at the top),
    followed by the first ``max_errors`` errors."""
    r = result
    lines = [" Serving Benchmark Result ".center(50, "=")]
    lines += [_line(label, value) for label, value in configured]
    lines += [
        _line("Successful requests:", r.completed),
        _line("Failed requests:", r.failed),
        _line("Benchmark duration (s):", r.duration),
        _line("Total input tokens:", r.total_input),
        _line("Total generated tokens:", r.total_output),
    ]
    if r.cached_tokens is not None:
        lines.append(_line("Cached prompt tokens:", r.cached_tokens))
        if r.cache_hit_rate is not None:
            lines.append(_line("Prefix cache hit rate (%):", 100.0 * r.cache_hit_rate))
    lines.append(_line("Request throughput (req/s):", r.request_throughput))
    if r.goodput is not None:
        lines.append(_line("Request goodput (req/s):", r.goodput))
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in r.slos_ms.items())
        lines.append(_line("Requests meeting SLOs:", f"{r.good_completed} ({slos})"))
    lines += [
        _line("Output token throughput (tok/s):", r.output_throughput),
        _line("Total token throughput (tok/s):", r.total_token_throughput),
        _line("Max concurrency observed:", r.max_concurrency_observed),
    ]
    shown = [p for p in r.percentiles if p != 50.0]
    for key, short, title in METRICS:
        stats = r.latency_ms[key]
        lines.append(title.center(50, "-"))
        lines.append(_line(f"Mean {short} (ms):", stats["mean"]))
        lines.append(_line(f"Median {short} (ms):", stats["median"]))
        for p in shown:
            name = percentile_key(p)
            lines.append(_line(f"{name.upper()} {short} (ms):", stats[name]))
    lines.append("=" * 50)
    errors = r.errors
    if errors:
        lines.append(f"Errors (first {min(max_errors, len(errors))} of {len(errors)}):")
        lines += [f"  {rid}: {msg}" for rid, msg in errors[:max_errors]]
    return "\n".join(lines)


def plot_latencies(result: BenchResult, path: str | Path, title: str = "") -> None:
    """Histograms (bars, left axis) and CDFs (lines, right axis) of TTFT, TPOT and ITL,
    and E2EL of the completed requests, in one 1x3 PNG (matplotlib's Agg canvas)."""
    from matplotlib.figure import Figure  # optional dependency: imported only here

    done = [r for r in result.requests if r.success]
    panels: list[tuple[str, dict[str, list[float]]]] = [
        ("TTFT", {"TTFT": [r.ttft * 1e3 for r in done if r.ttft is not None]}),
        (
            "TPOT and ITL",
            {
                "TPOT": [t * 1e3 for r in done if (t := r.tpot) is not None],
                "ITL": [g * 1e3 for r in done for g in r.itl],
            },
        ),
        ("E2EL", {"E2EL": [r.latency * 1e3 for r in done]}),
    ]
    fig = Figure(figsize=(16, 4.5))
    axes = fig.subplots(1, 3)
    for ax, (name, series) in zip(axes, panels, strict=True):
        cdf = ax.twinx()
        for i, (label, values) in enumerate(series.items()):
            if not values:
                continue
            color = f"C{i}"
            xs = np.sort(np.asarray(values))
            span = float(xs[-1] - xs[0])
            wide = span > 1e-6 * max(1.0, abs(float(xs[-1])))  # else numpy finds no bins
            bins = int(min(50, max(5, len(xs) // 2))) if wide else 1
            ax.hist(xs, bins=bins, alpha=0.45, color=color, label=f"{label} (n={len(xs)})")
            cdf.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color=color, lw=1.5)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        cdf.set_ylabel("CDF")
        cdf.set_ylim(0.0, 1.02)
        if any(series.values()):
            ax.legend(loc="center right", fontsize="small")
    fig.suptitle(title or "kvstack bench serve")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
