"""``kvstack plan --profile``: operator-level provisioning from a ``kvstack profile`` JSON.

OpScale (arXiv 2608.13499) provisions prefill and decode per operator, because their
operators are bound by different resources. Here that is arithmetic on the measured
figures of one profile (one machine, one batch, one context, one codec):

* a load of ``rate`` requests/s with ``prompt_tokens`` (of which ``prefix_hit_rate`` are
  cache hits) and ``output_tokens`` asks prefill for ``rate x prompt x (1 - hit)`` and
  decode for ``rate x output`` tokens/s;
* each operator's measured seconds per token times that rate is the machine time it
  needs per second (``machines``: 1.0 = one profiled machine fully busy); split by the
  operator's roofline class (compute-bound, memory-bound, overhead = Python etc.);
* the FLOP/s and bytes/s the phase then needs, as multiples of this machine's measured
  GEMM peak and bandwidth, say which resource the phase runs out of first;
* decode's KV: Little's law, concurrent requests = rate x output tokens x decode step
  time (at the profiled batch), each holding ``prompt + output`` tokens of KV.

Not modelled: how operator times change with batch size or context (the profile's
figures are used as they are; profile at the batch and context you will run), queueing
and latency targets (TTFT, ITL), prefill and decode interfering on one machine, the
transfer of KV between prefill and decode machines, and weight memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError

SCHEMA = "kvstack-profile/1"


@dataclass(frozen=True)
class PhaseDemand:
    phase: str
    tokens_per_s: float  # the load's demand
    measured_tokens_per_s: float  # one profiled machine
    machines: float  # machine time per second (1.0 = one machine fully busy)
    compute_machines: float  # of which in compute-bound operators
    memory_machines: float  # in memory-bound operators
    overhead_machines: float  # outside operators (Python, sampling, inputs)
    flop_s: float
    bytes_s: float
    peak_multiple: float  # flop_s / the machine's measured GEMM peak
    bandwidth_multiple: float  # bytes_s / the machine's measured bandwidth
    needs: str  # "compute", "memory bandwidth" or "host overhead"
    top_ops: list[tuple[str, float]] = field(default_factory=list)  # (name, machines)


@dataclass(frozen=True)
class OperatorPlan:
    profile: str
    rate: float
    prompt_tokens: int
    output_tokens: int
    prefix_hit_rate: float
    phases: list[PhaseDemand]
    decode_concurrency: float
    kv_bytes: float  # KV of the concurrent decoding requests
    not_modelled: str = (
        "batch/context scaling of operator times, queueing and latency targets, "
        "prefill/decode interference, KV transfer between machines, weight memory"
    )


def load_profile(path: str | Path) -> dict[str, Any]:
    """A profile JSON, checked enough that the arithmetic below cannot fail on it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read profile {path}: {e}") from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ConfigError(f"{path} is not a kvstack profile JSON (schema {SCHEMA})")
    for phase in ("prefill", "decode"):
        ph = data.get("phases", {}).get(phase)
        if not ph or not ph.get("tokens") or not ph.get("ops"):
            raise ConfigError(f"{path}: the profile has no measured {phase} phase")
    return data


def _phase(name: str, ph: dict[str, Any], bounds: dict[str, Any], rate: float) -> PhaseDemand:
    per_token = {r["name"]: r["seconds"] / ph["tokens"] for r in ph["ops"]}
    cls = {r["name"]: r["bound"] for r in ph["ops"]}
    machines = {n: s * rate for n, s in per_token.items()}

    def share(kind: str) -> float:
        return sum(m for n, m in machines.items() if cls[n] == kind)

    total = sum(machines.values())
    flop_s = rate * ph["flops_per_token"]
    bytes_s = rate * ph["bytes_per_token"]
    split = {"compute": share("compute"), "memory bandwidth": share("memory")}
    split["host overhead"] = share("overhead")
    top = sorted(((n, m) for n, m in machines.items()), key=lambda x: -x[1])[:3]
    return PhaseDemand(
        phase=name,
        tokens_per_s=rate,
        measured_tokens_per_s=ph["tokens"] / ph["wall_s"] if ph["wall_s"] else 0.0,
        machines=total,
        compute_machines=split["compute"],
        memory_machines=split["memory bandwidth"],
        overhead_machines=split["host overhead"],
        flop_s=flop_s,
        bytes_s=bytes_s,
        peak_multiple=flop_s / (bounds["peak_gflop_s"] * 1e9),
        bandwidth_multiple=bytes_s / (bounds["bandwidth_gb_s"] * 1e9),
        needs=max(split, key=lambda k: split[k]),
        top_ops=top,
    )


def make_operator_plan(
    profile_path: str | Path,
    rate: float,
    prompt_tokens: int,
    output_tokens: int,
    prefix_hit_rate: float = 0.0,
) -> OperatorPlan:
    """The provisioning of ``rate`` requests/s on the profiled machine (module docstring)."""
    if rate <= 0 or prompt_tokens < 1 or output_tokens < 1:
        raise ConfigError("--rate must be > 0, --prompt-tokens and --output-tokens >= 1")
    if not 0 <= prefix_hit_rate < 1:
        raise ConfigError(f"--prefix-hit-rate must be in [0, 1), got {prefix_hit_rate}")
    prof = load_profile(profile_path)
    ph, bounds = prof["phases"], prof["bounds"]
    prefill = _phase("prefill", ph["prefill"], bounds, rate * prompt_tokens * (1 - prefix_hit_rate))
    decode = _phase("decode", ph["decode"], bounds, rate * output_tokens)
    step_s = ph["decode"]["step_ms_median"] / 1e3
    concurrency = rate * output_tokens * step_s
    kv = concurrency * (prompt_tokens + output_tokens) * prof.get("kv_bytes_per_token", 0.0)
    return OperatorPlan(
        str(profile_path),
        rate,
        prompt_tokens,
        output_tokens,
        prefix_hit_rate,
        [prefill, decode],
        concurrency,
        kv,
    )


def format_operator_plan(p: OperatorPlan) -> str:
    lines = [
        f"load: {p.rate:g} req/s x ({p.prompt_tokens} prompt, {p.prefix_hit_rate:g} cached, "
        f"{p.output_tokens} output) tokens; figures of {p.profile}",
        "| phase | tokens/s | machines | compute-bound | memory-bound | overhead | FLOP/s "
        "x peak | bytes/s x bandwidth | needs more |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in p.phases:
        lines.append(
            f"| {d.phase} | {d.tokens_per_s:,.0f} | {d.machines:.2f} | {d.compute_machines:.2f} "
            f"| {d.memory_machines:.2f} | {d.overhead_machines:.2f} | {d.peak_multiple:.2f} | "
            f"{d.bandwidth_multiple:.2f} | {d.needs} |"
        )
    for d in p.phases:
        ops = ", ".join(f"{n} {m:.2f}" for n, m in d.top_ops)
        lines.append(f"{d.phase}: most machine time in {ops} (machines)")
    lines.append(
        f"decode holds {p.decode_concurrency:.1f} requests at once (Little's law at the "
        f"profiled step time): {p.kv_bytes / 2**30:.2f} GiB of KV"
    )
    lines.append(f"not modelled: {p.not_modelled}")
    return "\n".join(lines)
