"""``kvstack bench serve``: an async benchmark client for any OpenAI-compatible server.

It sends a workload (:mod:`kvstack.tools.workloads`, or a JSONL file written by
:func:`~kvstack.tools.workloads.write_jsonl`) to kvstack, vLLM, SGLang or llama.cpp's
server and reports what ``vllm bench serve`` reports (vLLM's
``benchmarks/benchmark_serving.py`` is the model for the metrics, see :mod:`.report`),
plus the prefix-cache hit rate when the server returns
``usage.prompt_tokens_details.cached_tokens``.

The modules: ``stream`` parses the streamed responses, ``traffic`` decides when each
request is sent (arrivals, session rounds, concurrency), ``client`` sends them
(:func:`run_benchmark` is the API for scripts), ``report`` computes the statistics, the
text report and the plot, ``cli`` is the command line.
"""

from kvstack.tools.bench.cli import add_bench_serve_args, load_requests, main, run_bench_serve
from kvstack.tools.bench.client import (
    BenchConfig,
    build_payload,
    normalize_base_url,
    run_benchmark,
    send_request,
)
from kvstack.tools.bench.report import BenchResult, RequestResult, calculate_metrics
from kvstack.tools.bench.stream import DONE, StreamAccumulator, parse_sse_line
from kvstack.tools.bench.traffic import (
    arrival_offsets,
    order_requests,
    run_schedule,
    session_dependencies,
)

__all__ = [
    "DONE",
    "BenchConfig",
    "BenchResult",
    "RequestResult",
    "StreamAccumulator",
    "add_bench_serve_args",
    "arrival_offsets",
    "build_payload",
    "calculate_metrics",
    "load_requests",
    "main",
    "normalize_base_url",
    "order_requests",
    "parse_sse_line",
    "run_bench_serve",
    "run_benchmark",
    "run_schedule",
    "send_request",
    "session_dependencies",
]
