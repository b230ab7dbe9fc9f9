"""A vLLM backend's load, read from its Prometheus ``/metrics`` (vLLM has no ``/load``).

``kvstack router`` polls ``GET /load`` on kvstack replicas; a vLLM server answers 404
there, so the router reads the same three numbers from the families vLLM exports (the
ones llm-d's and the Gateway API Inference Extension's scorers read):
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` summed over the
server's engines, ``vllm:kv_cache_usage_perc`` their maximum. A page without them
(not a vLLM server) gives None: the backend is routed without load information, as
before.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families


def load_from_metrics(text: str) -> tuple[int, int, float] | None:
    """``(running, waiting, kv_usage)`` of a vLLM ``/metrics`` page, or None."""
    values: dict[str, list[float]] = {}
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    try:
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                values[family.name] = [s.value for s in family.samples if math.isfinite(s.value)]
    except ValueError:
        return None
    if not all(values.get(name) for name in wanted):
        return None
    running, waiting, usage = (values[name] for name in wanted)
    return int(sum(running)), int(sum(waiting)), max(usage)
