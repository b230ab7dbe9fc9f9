"""What ``bench serve --workload agent-loop`` reports besides the usual (:mod:`.report`).

Pure functions of the run's records (:class:`AgentStep` next to each
:class:`~.report.RequestResult`), so they are tested without a server:

- **valid tool calls**: call requests whose streamed ``tool_calls`` were all valid (one or
  more calls; each of a tool of the request, with arguments that validate against its
  ``parameters``), over the call requests that completed;
- **tool schema share**: tool-schema tokens / prompt tokens (``usage.prompt_tokens``),
  summed over the completed requests whose tool tokens were counted;
- **hit rates** (cached / prompt tokens, ``usage.prompt_tokens_details.cached_tokens``):
  on later turns (turn >= 1), and per request kind (``call``, ``answer``);
- **TTFT** median and p90 per request kind (milliseconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstack.tools.bench.report import RequestResult, latency_stats
from kvstack.tools.workloads.spec import WorkloadSpec


@dataclass
class AgentStep:
    """The agent side of one request: where it is in its session and what came back."""

    session: int
    turn: int
    kind: str  # "call" (forced tool_choice) or "answer" (tool_choice "none")
    tool_tokens: int | None  # tool-schema tokens of its prompt; None: not counted
    problems: list[str] = field(default_factory=list)  # call requests: why not valid


@dataclass
class AgentSummary:
    """The agent-loop figures of one run (module docstring)."""

    sessions: int
    turns: int
    tools_per_request: int
    tool_choice: str  # "required" or "named"
    requests_planned: int
    requests_sent: int
    call_requests: int  # completed
    valid_calls: int
    valid_call_rate: float | None
    tool_tokens_source: str | None
    tool_tokens_mean: float | None  # per request
    tool_schema_share: float | None
    hit_rate_later_turns: float | None
    hit_rate_by_kind: dict[str, float | None]
    ttft_ms_by_kind: dict[str, dict[str, float]]
    problems: list[str]  # the first few reasons a call was not valid

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _hit_rate(pairs: Sequence[tuple[RequestResult, AgentStep]]) -> float | None:
    rs = [r for r, _ in pairs if r.success and r.cached_tokens is not None]
    total = sum(r.input_len for r in rs)
    return sum(r.cached_tokens or 0 for r in rs) / total if total else None


def summarize_agent(
    spec: WorkloadSpec,
    num_sessions: int,
    results: Sequence[RequestResult],
    steps: Sequence[AgentStep],
    source: str | None,
    max_problems: int = 5,
) -> AgentSummary:
    """The figures of a run of the resolved ``spec`` (``results[i]`` is ``steps[i]``)."""
    pairs = list(zip(results, steps, strict=True))
    done = [(r, s) for r, s in pairs if r.success]
    calls = [s for _, s in done if s.kind == "call"]
    valid = sum(not s.problems for s in calls)
    counted = [(r, s) for r, s in done if s.tool_tokens is not None and r.input_len]
    tool_total = sum(s.tool_tokens or 0 for _, s in counted)
    prompt_total = sum(r.input_len for r, _ in counted)
    kinds = ("call", "answer") if spec.answer_len else ("call",)
    per_turn = int(spec.num_turns or 0) * (2 if spec.answer_len else 1)
    return AgentSummary(
        sessions=num_sessions,
        turns=int(spec.num_turns or 0),
        tools_per_request=int(spec.tools_per_request or 0),
        tool_choice="named" if spec.named_tool_choice else "required",
        requests_planned=num_sessions * per_turn,
        requests_sent=len(results),
        call_requests=len(calls),
        valid_calls=valid,
        valid_call_rate=valid / len(calls) if calls else None,
        tool_tokens_source=source,
        tool_tokens_mean=tool_total / len(counted) if counted else None,
        tool_schema_share=tool_total / prompt_total if prompt_total else None,
        hit_rate_later_turns=_hit_rate([(r, s) for r, s in done if s.turn > 0]),
        hit_rate_by_kind={k: _hit_rate([(r, s) for r, s in done if s.kind == k]) for k in kinds},
        ttft_ms_by_kind={
            k: {
                key: v
                for key, v in latency_stats(
                    [r.ttft for r, s in done if s.kind == k and r.ttft is not None], [90.0]
                ).items()
                if key in ("median", "p90")
            }
            for k in kinds
        },
        problems=[p for s in calls for p in s.problems][:max_problems],
    )


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100.0 * value:.2f}"


def format_agent_report(s: AgentSummary) -> str:
    """The agent-loop block printed after the serving report."""
    rows: list[tuple[str, object]] = [
        ("Sessions x turns:", f"{s.sessions} x {s.turns}"),
        ("Requests sent (planned):", f"{s.requests_sent} ({s.requests_planned})"),
        ("Tools per request / tool_choice:", f"{s.tools_per_request} / {s.tool_choice}"),
        (
            "Valid tool calls (%):",
            f"{_pct(s.valid_call_rate)} ({s.valid_calls} of {s.call_requests})",
        ),
        (
            "Tool schema tokens per request:",
            "n/a" if s.tool_tokens_mean is None else f"{s.tool_tokens_mean:.1f}",
        ),
        ("Tool schema share of prompt (%):", _pct(s.tool_schema_share)),
        ("  counted with:", s.tool_tokens_source or "n/a"),
        ("Prefix cache hit rate, turns >= 1 (%):", _pct(s.hit_rate_later_turns)),
    ]
    for kind, rate in s.hit_rate_by_kind.items():
        rows.append((f"Prefix cache hit rate, {kind} (%):", _pct(rate)))
    for kind, stats in s.ttft_ms_by_kind.items():
        rows.append(
            (f"TTFT {kind} median / p90 (ms):", f"{stats['median']:.2f} / {stats['p90']:.2f}")
        )
    lines = [" Agent loop ".center(50, "-")]
    lines += [f"{label:<40} {value}".rstrip() for label, value in rows]
    if s.problems:
        lines.append(f"Invalid calls (first {len(s.problems)}):")
        lines += [f"  {p[:160]}" for p in s.problems]
    lines.append("=" * 50)
    return "\n".join(lines)
