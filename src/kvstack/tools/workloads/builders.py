"""The nine workload builders: seeded text, rendered with the chat template, in arrival order.

Each builder draws its text from sub-generators seeded by ``(seed, workload, piece)``
(:func:`_rng`), so text shared between requests does not depend on ``num_requests``, and
renders every request with the tokenizer's chat template: ``prompt_token_ids`` are exactly
what the engine prefills. The layouts are in the package docstring (:mod:`kvstack.tools.workloads`).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from kvstack.core.errors import ConfigError
from kvstack.tools.workloads.agent import agent_loop_requests
from kvstack.tools.workloads.shuffled import agent_tools_shuffled, rag_shuffled
from kvstack.tools.workloads.spec import WorkloadRequest, WorkloadSpec
from kvstack.tools.workloads.text import (
    QUESTION_OPENERS,
    TASK_FAMILIES,
    TextMaker,
    TokenizerLike,
    agent_system,
    few_shot_messages,
    persona,
    sys_user,
    tool_call_reply,
)

if TYPE_CHECKING:
    from kvstack.model.tokenizer.tokenizer import Tokenizer


def _n(value: int | float | None) -> int:
    assert value is not None, "use WorkloadSpec.resolved() first"
    return int(value)


def _rng(spec: WorkloadSpec, *parts: object) -> random.Random:
    """A sub-generator per piece, so shared text does not depend on num_requests."""
    return random.Random("/".join(map(str, (spec.seed, spec.name, *parts))))


class _Builder:
    """Renders messages with the chat template and numbers requests in arrival order."""

    def __init__(self, spec: WorkloadSpec, tokenizer: TokenizerLike) -> None:
        self.spec, self.tok, self.maker = spec, tokenizer, TextMaker(tokenizer)
        self.out: list[WorkloadRequest] = []

    def add(
        self, rid: str, messages: list[dict[str, str]], session: str | None, rnd: int = 0
    ) -> None:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(text, str)
        ids = self.tok.encode(text, add_special_tokens=False)
        msgs = [dict(m) for m in messages]
        args = (session, rnd, len(self.out))
        self.out.append(WorkloadRequest(rid, ids, msgs, text, self.spec.max_tokens, *args))

    def question(self, rng: random.Random, n_tokens: int, label: str = "") -> str:
        return self.maker.text(rng, n_tokens, f"{label} {rng.choice(QUESTION_OPENERS)}".strip())

    def conversations(
        self,
        system: str,
        user: Callable[[random.Random, int], str],
        assistant: Callable[[random.Random, int], str],
    ) -> None:
        """``ceil(n / num_turns)`` conversations, cut to n requests; round-major arrivals."""
        spec, turns = self.spec, _n(self.spec.num_turns)
        items: list[tuple[int, int, list[dict[str, str]]]] = []
        for c in range(math.ceil(spec.num_requests / turns)):
            rng = _rng(spec, "conv", c)
            msgs = [{"role": "system", "content": system}]
            for k in range(min(turns, spec.num_requests - c * turns)):
                if k:
                    msgs.append({"role": "assistant", "content": assistant(rng, k - 1)})
                msgs.append({"role": "user", "content": user(rng, k)})
                items.append((k, c, list(msgs)))
        for k, c, msgs in sorted(items, key=lambda item: item[:2]):
            self.add(f"{spec.name}-c{c}-t{k}", msgs, f"conv-{c}", k)


def _random(b: _Builder) -> None:
    # The template adds its default system prompt when there is none: the shared header.
    header = len(b.tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=True))
    for i in range(b.spec.num_requests):
        text = b.question(_rng(b.spec, "req", i), max(1, _n(b.spec.prompt_len) - header))
        b.add(f"random-{i}", [{"role": "user", "content": text}], None)


def _shared_prefix(b: _Builder) -> None:
    spec = b.spec
    head, mid, tail = b.maker.template_overheads()
    sys_len = _n(spec.shared_prefix_len) - head - mid
    q_len = _n(spec.prompt_len) - _n(spec.shared_prefix_len) - tail
    if sys_len < 1 or q_len < 1:
        raise ConfigError(
            f"shared-prefix needs shared_prefix_len >= {head + mid + 1} and prompt_len >= "
            f"shared_prefix_len + {tail + 1} (template overhead)"
        )
    groups = _n(spec.num_groups)
    systems = []
    for g in range(groups):
        systems.append(b.maker.text(_rng(spec, "group", g), sys_len, f"You are {persona(g)}."))
    for i in range(spec.num_requests):
        g = i % groups
        question = b.question(_rng(spec, "req", i), q_len)
        b.add(f"shared-prefix-{i}", sys_user(systems[g], question), f"group-{g}")


def _multi_turn(b: _Builder) -> None:
    spec = b.spec
    system = b.maker.text(_rng(spec, "system"), _n(spec.system_len), "You are a helpful guide.")
    b.conversations(
        system,
        lambda rng, k: b.question(rng, _n(spec.user_len)),
        lambda rng, k: b.maker.text(rng, _n(spec.assistant_len), "Sure."),
    )


def _few_shot(b: _Builder) -> None:
    spec = b.spec
    preamble = b.maker.text(_rng(spec, "preamble"), _n(spec.system_len), "Follow the examples.")
    prefixes = [
        few_shot_messages(
            _rng(spec, "family", f), b.maker, preamble, f, _n(spec.shots), _n(spec.shot_len)
        )
        for f in range(_n(spec.num_groups))
    ]
    for i in range(spec.num_requests):
        f = i % len(prefixes)
        label = TASK_FAMILIES[f % len(TASK_FAMILIES)][1] + ":"
        question = b.question(_rng(spec, "req", i), _n(spec.question_len), label)
        b.add(f"few-shot-{i}", [*prefixes[f], {"role": "user", "content": question}], f"family-{f}")


def _rag_qa(b: _Builder) -> None:
    spec = b.spec
    lead = "Answer using only the documents given and name the document you used."
    system = b.maker.text(_rng(spec, "system"), _n(spec.system_len), lead)
    num_docs = _n(spec.num_docs)
    docs = [
        b.maker.text(_rng(spec, "doc", d), _n(spec.doc_len), f"Document {d + 1}:")
        for d in range(num_docs)
    ]
    weights = [1.0 / (d + 1) ** float(spec.zipf_s or 0.0) for d in range(num_docs)]
    for i in range(spec.num_requests):
        rng = _rng(spec, "req", i)
        chosen: list[int] = []
        while len(chosen) < _n(spec.docs_per_request):  # draw without replacement
            rest = [d for d in range(num_docs) if d not in chosen]
            chosen.append(rng.choices(rest, [weights[d] for d in rest])[0])
        question = b.question(rng, _n(spec.question_len), "Question:")
        user = "\n\n".join([*(docs[d] for d in chosen), question])
        b.add(f"rag-qa-{i}", sys_user(system, user), "doc-" + "+".join(map(str, chosen)))


def _agent_tools(b: _Builder) -> None:
    spec = b.spec
    rng = _rng(spec, "system")
    system, names = agent_system(rng, b.maker, _n(spec.system_len), _n(spec.tool_schema_len))
    b.conversations(
        system,
        lambda rng, k: b.question(rng, _n(spec.user_len)),
        lambda rng, k: tool_call_reply(rng, b.maker, names, k, _n(spec.assistant_len)),
    )


def _agent_loop(b: _Builder) -> None:
    # Scripted calls (see tools/workloads/agent.py): the live loop is bench serve's.
    b.out.extend(agent_loop_requests(b.spec, cast("Tokenizer", b.tok)))


_BUILDERS: dict[str, Callable[[_Builder], None]] = {
    "random": _random,
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "few-shot": _few_shot,
    "rag-qa": _rag_qa,
    "agent-tools": _agent_tools,
    "agent-loop": _agent_loop,
    "agent-tools-shuffled": lambda b: b.out.extend(
        agent_tools_shuffled(b.spec, cast("Tokenizer", b.tok))
    ),
    "rag-shuffled": lambda b: b.out.extend(rag_shuffled(b.spec, cast("Tokenizer", b.tok))),
}


def build_workload(spec: WorkloadSpec, tokenizer: TokenizerLike) -> list[WorkloadRequest]:
    """The requests of ``spec`` (resolved and validated first), in arrival order."""
    builder = _Builder(spec.resolved(), tokenizer)
    _BUILDERS[builder.spec.name](builder)
    return builder.out


def make_spec(
    name: str, num_requests: int, seed: int = 0, max_tokens: int = 64, **overrides: Any
) -> WorkloadSpec:
    """The resolved spec of workload ``name``; ``overrides`` set WorkloadSpec knobs
    (``ConfigError`` for an unknown knob or a bad value)."""
    knobs = [f.name for f in dataclasses.fields(WorkloadSpec)[4:]]
    if unknown := sorted(set(overrides) - set(knobs)):
        raise ConfigError(f"unknown knob(s) {', '.join(unknown)}; valid: {', '.join(knobs)}")
    return WorkloadSpec(name, num_requests, seed, max_tokens, **overrides).resolved()


def make_workload(
    name: str,
    tokenizer: TokenizerLike,
    num_requests: int,
    seed: int = 0,
    max_tokens: int = 64,
    **overrides: Any,
) -> list[WorkloadRequest]:
    """``num_requests`` requests of workload ``name``; ``overrides`` set WorkloadSpec knobs."""
    return build_workload(make_spec(name, num_requests, seed, max_tokens, **overrides), tokenizer)
