"""A workload's knobs (:class:`WorkloadSpec`) and its requests (:class:`WorkloadRequest`).

:data:`DEFAULTS` lists, per workload, the knobs that apply to it and their defaults; any
other knob is rejected by :meth:`WorkloadSpec.resolved`, which also checks every value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kvstack.core.errors import ConfigError
from kvstack.tools.workloads.agent_pool import POOL_SIZE

# Per-workload defaults of the knobs that apply to it; other knobs are rejected.
DEFAULTS: dict[str, dict[str, int | float | None]] = {
    "random": {"prompt_len": 200},
    "shared-prefix": {"prompt_len": 200, "shared_prefix_len": 144, "num_groups": None},
    "multi-turn": {"system_len": 400, "num_turns": 5, "user_len": 60, "assistant_len": 80},
    "few-shot": dict(system_len=200, num_groups=2, shots=8, shot_len=100, question_len=30),
    "rag-qa": dict(
        system_len=30, num_docs=4, doc_len=1000, docs_per_request=1, question_len=30, zipf_s=1.0
    ),
    "agent-tools": dict(
        system_len=60, tool_schema_len=1500, num_turns=1, user_len=40, assistant_len=40
    ),
    "agent-loop": dict(
        num_sessions=None,
        num_turns=3,
        system_len=150,
        user_len=0,
        num_tools=POOL_SIZE,
        tools_per_request=8,
        num_tool_sets=None,
        tool_result_len=60,
        answer_len=32,
        named_tool_choice=0,
    ),
    # Segment reuse (``shuffled.py``): shared pieces in any subset and order.
    "agent-tools-shuffled": dict(system_len=40, num_tools=20),
    "rag-shuffled": dict(system_len=20, num_docs=30, doc_len=200, question_len=30),
}
WORKLOADS: tuple[str, ...] = tuple(DEFAULTS)
GROUP_SIZE = 32  # shared-prefix: default num_groups = ceil(num_requests / 32)
# Knobs that must be >= 1 (all others must be >= 0).
_AT_LEAST_ONE = (
    "num_requests max_tokens num_groups num_turns num_docs shots docs_per_request "
    "num_sessions num_tools tools_per_request num_tool_sets"
)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload; see the module docstring for ``round``."""

    request_id: str
    prompt_token_ids: list[int]  # exact tokens sent to the engine (chat template applied)
    messages: list[dict[str, Any]] | None  # chat messages (OpenAI shape), None for raw prompts
    prompt: str  # text form: the rendered template (decodes to about the same)
    max_tokens: int
    session_id: str | None  # conversation id (multi-turn, agent-tools), group id otherwise
    round: int  # may depend on requests of earlier rounds; benchmarks run rounds in order
    arrival_index: int  # global order
    body_extra: dict[str, Any] | None = None  # more body fields (agent-loop: tools, tool_choice)
    # Segment token ranges [start, end) of prompt_token_ids (the *-shuffled workloads).
    segments: list[list[Any]] | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload's knobs; ``None`` means the workload's default (:data:`DEFAULTS`).

    Token lengths are targets for message *content* unless said otherwise:

    - ``prompt_len``: whole prompt incl. template (random 200, shared-prefix 200).
    - ``shared_prefix_len``: tokens every prompt of a group shares, template header
      included (shared-prefix 144, as in ``benchmarks/workload.py``; 1000 works too).
    - ``num_groups``: shared-prefix groups (``ceil(num_requests / 32)``), few-shot task
      families (2). Request ``i`` belongs to group ``i % num_groups``.
    - ``system_len``: system prompt (multi-turn 400, shared by every conversation: with 300
      the ideal hit rate of 40 requests is 0.78, with 400 it is 0.80); few-shot
      preamble shared by all families (200); rag-qa system line (30); agent-tools
      instructions before the tool block (60).
    - ``num_turns``: requests per conversation (multi-turn 5, agent-tools 1).
    - ``user_len`` / ``assistant_len``: each user message / synthetic assistant reply in
      the history (multi-turn 60/80, agent-tools 40/40).
    - ``shots`` / ``shot_len``: examples per few-shot family (8) and tokens per example,
      input plus answer (100); ``question_len``: the final question (few-shot, rag-qa 30).
    - ``num_docs`` / ``doc_len`` / ``docs_per_request`` / ``zipf_s``: rag-qa corpus (4
      documents of 1000 tokens), documents per request (1, or 2), and the skew: document
      ``d`` is drawn with weight ``1 / (d + 1) ** zipf_s`` (1.0).
    - ``tool_schema_len``: the ``<tools>`` block of JSON function schemas (1500).
    - agent-loop (:mod:`.agent`; ``system_len`` 150, ``num_turns`` 3, ``user_len`` 0 = the
      task text alone): ``num_sessions`` (default: whole sessions for ``num_requests``),
      ``num_tools`` (first tools of the pool used, 16 = all), ``tools_per_request`` (8),
      ``num_tool_sets`` (distinct seeded tool subsets, default one per session),
      ``tool_result_len`` (filler tokens in each tool result, 60), ``answer_len`` (max
      tokens of the answer after each result, 32; 0 = no answer requests) and
      ``named_tool_choice`` (0: ``tool_choice`` "required"; 1: the turn's tool by name).
    """

    name: str
    num_requests: int
    seed: int = 0
    max_tokens: int = 64
    prompt_len: int | None = None
    shared_prefix_len: int | None = None
    num_groups: int | None = None
    system_len: int | None = None
    num_turns: int | None = None
    user_len: int | None = None
    assistant_len: int | None = None
    shots: int | None = None
    shot_len: int | None = None
    question_len: int | None = None
    num_docs: int | None = None
    doc_len: int | None = None
    docs_per_request: int | None = None
    zipf_s: float | None = None
    tool_schema_len: int | None = None
    num_sessions: int | None = None
    num_tools: int | None = None
    tools_per_request: int | None = None
    num_tool_sets: int | None = None
    tool_result_len: int | None = None
    answer_len: int | None = None
    named_tool_choice: int | None = None

    def resolved(self) -> WorkloadSpec:
        """Validated copy with every knob of this workload set (``ConfigError`` if bad)."""
        if self.name not in DEFAULTS:
            raise ConfigError(
                f"unknown workload {self.name!r}; valid names: {', '.join(WORKLOADS)}"
            )
        defaults = DEFAULTS[self.name]
        values: dict[str, Any] = {}
        for f in dataclasses.fields(self)[4:]:
            value = getattr(self, f.name)
            if value is not None and f.name not in defaults:
                raise ConfigError(
                    f"knob {f.name!r} does not apply to workload {self.name!r} "
                    f"(its knobs: {', '.join(defaults)})"
                )
            values[f.name] = defaults.get(f.name) if value is None else value
        if self.name == "shared-prefix" and values["num_groups"] is None:
            values["num_groups"] = max(1, math.ceil(self.num_requests / GROUP_SIZE))
        checks: dict[str, Any] = dict(values, num_requests=self.num_requests)
        checks["max_tokens"] = self.max_tokens
        for key, value in checks.items():
            kinds: tuple[type[int] | type[float], ...] = (int, float) if key == "zipf_s" else (int,)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
                raise ConfigError(f"{key} must be {' or '.join(k.__name__ for k in kinds)}")
            low = 1 if key in _AT_LEAST_ONE.split() else 0
            if value is not None and value < low:
                raise ConfigError(f"{key} must be >= {low}, got {value!r}")
        if self.name == "rag-qa" and values["docs_per_request"] > values["num_docs"]:
            raise ConfigError("docs_per_request must be <= num_docs")
        if self.name == "agent-loop":
            _check_agent_loop(values)
        return dataclasses.replace(self, **values)


def _check_agent_loop(values: dict[str, Any]) -> None:
    if values["num_tools"] > POOL_SIZE:
        raise ConfigError(
            f"num_tools must be <= {POOL_SIZE} (the tool pool), got {values['num_tools']}"
        )
    if values["tools_per_request"] > values["num_tools"]:
        raise ConfigError("tools_per_request must be <= num_tools")
    if values["named_tool_choice"] not in (0, 1):
        raise ConfigError(f"named_tool_choice must be 0 or 1, got {values['named_tool_choice']}")


def parse_knob(text: str) -> tuple[str, float | int]:
    """``KNOB=VALUE`` of ``--set`` -> ``(knob, int or float)`` (an argparse type)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), int(value) if value.strip().lstrip("-").isdigit() else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: not a number: {value!r}") from None
