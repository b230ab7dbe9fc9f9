"""Deterministic, tokenizer-aware synthetic workloads for prefix-cache studies.

Every workload is a list of chat requests (OpenAI ``messages``) whose ``prompt_token_ids``
are the model's chat template applied to the messages, exactly what the engine prefills.
Text comes from fixed word lists drawn with ``random.Random`` seeded by ``seed`` (see
:mod:`kvstack.tools.workload_text`), measured with the real tokenizer, so lengths land
within a few tokens of their targets and the same arguments always give the same ids.

**Hit rate** = cached prompt tokens / prompt tokens. :func:`ideal_hit_rate` is its upper
bound with an infinite cache: for each request (rounds in order), the longest run of full
blocks that an earlier prompt already contained, never the whole prompt. Layouts
(``H`` = template header, ``=`` shared, ``.`` private to one request)::

    random         |H|.......... prompt_len (200) .........|     nothing shared beyond H
    shared-prefix  |H=system of its group==|....question...|     groups of 32 requests;
                   |<-- shared_prefix_len (144) -->|        |    prompt_len 200 in all
    multi-turn     |H=system (400)=|u0..|a0..|u1..|a1..|u2..|    turn k resends turn k-1's
                   |== shared by all ==|<- turn k-1 prompt ->|    prompt + a(k-1) + u(k)
    few-shot       |H=preamble=|=task=|=8 shots (family)=|.q.|   shots fixed per family
    rag-qa         |H=system=|== document d (1000) ==|.q.|       d ~ Zipf over num_docs
    agent-tools    |H=instructions + <tools> JSON (1500)=|.user (40).| (+ turns: rounds)

``round`` orders dependencies: turn k of a conversation is round k and needs turn k-1's
reply; single-turn workloads are all round 0. In multi-turn histories the assistant replies
are synthetic fixed text (``assistant_len`` tokens): the real engine's replies differ, so a
benchmark resending these histories prefills those tokens rather than reusing the decode's
KV; the ideal hit rate counts only prompt tokens that an earlier *prompt* contained.

Run ``python -m kvstack.tools.workloads NAME --num-requests N --out FILE.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.errors import ConfigError, KvstackError
from kvstack.kv.hashing import hash_blocks, root_hash
from kvstack.tools.workload_text import (
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
}
WORKLOADS: tuple[str, ...] = tuple(DEFAULTS)
GROUP_SIZE = 32  # shared-prefix: default num_groups = ceil(num_requests / 32)
# Knobs that must be >= 1 (all others must be >= 0).
_AT_LEAST_ONE = "num_requests max_tokens num_groups num_turns num_docs shots docs_per_request"


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload; see the module docstring for ``round``."""

    request_id: str
    prompt_token_ids: list[int]  # exact tokens sent to the engine (chat template applied)
    messages: list[dict[str, str]] | None  # chat messages (OpenAI shape), None for raw prompts
    prompt: str  # text form: the rendered template (decodes to about the same)
    max_tokens: int
    session_id: str | None  # conversation id (multi-turn, agent-tools), group id otherwise
    round: int  # may depend on requests of earlier rounds; benchmarks run rounds in order
    arrival_index: int  # global order


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
        return dataclasses.replace(self, **values)


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


_BUILDERS: dict[str, Callable[[_Builder], None]] = {
    "random": _random,
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "few-shot": _few_shot,
    "rag-qa": _rag_qa,
    "agent-tools": _agent_tools,
}


def build_workload(spec: WorkloadSpec, tokenizer: TokenizerLike) -> list[WorkloadRequest]:
    """The requests of ``spec`` (resolved and validated first), in arrival order."""
    builder = _Builder(spec.resolved(), tokenizer)
    _BUILDERS[builder.spec.name](builder)
    return builder.out


def make_workload(
    name: str,
    tokenizer: TokenizerLike,
    num_requests: int,
    seed: int = 0,
    max_tokens: int = 64,
    **overrides: Any,
) -> list[WorkloadRequest]:
    """``num_requests`` requests of workload ``name``; ``overrides`` set WorkloadSpec knobs."""
    knobs = {f.name for f in dataclasses.fields(WorkloadSpec)[4:]}
    if unknown := sorted(set(overrides) - knobs):
        raise ConfigError(f"unknown knob(s) {', '.join(unknown)}; valid: {', '.join(knobs)}")
    return build_workload(
        WorkloadSpec(name, num_requests, seed, max_tokens, **overrides), tokenizer
    )


def ideal_hit_rate(requests: Sequence[WorkloadRequest], block_size: int = 16) -> float:
    """Prefix-cache hit rate with an infinite cache (see the module docstring)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    root, seen = root_hash(), set()
    hits = total = 0
    for req in sorted(requests, key=lambda r: (r.round, r.arrival_index)):
        ids = req.prompt_token_ids
        hashes = hash_blocks(ids, block_size, root)
        for h in hashes[: max(0, len(ids) - 1) // block_size]:
            if h not in seen:
                break
            hits += block_size
        seen.update(hashes)
        total += len(ids)
    return hits / total if total else 0.0


def _to_json(req: WorkloadRequest) -> dict[str, Any]:
    body: dict[str, Any]
    body = {"prompt": req.prompt} if req.messages is None else {"messages": req.messages}
    row = {k: v for k, v in dataclasses.asdict(req).items() if k not in ("messages", "prompt")}
    return {**row, **body, "prompt": req.prompt, "body": {**body, "max_tokens": req.max_tokens}}


def write_jsonl(requests: Sequence[WorkloadRequest], path: str | Path) -> None:
    """One JSON object per request and line: the fields, ``messages`` for chat requests,
    ``prompt`` (always, so that :func:`read_jsonl` round-trips exactly) and ``body``, the
    OpenAI-style request body (``{"messages" | "prompt", "max_tokens"}``)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(_to_json(r), ensure_ascii=False) + "\n" for r in requests)


def read_jsonl(path: str | Path) -> list[WorkloadRequest]:
    """The requests written by :func:`write_jsonl`."""
    names = [f.name for f in dataclasses.fields(WorkloadRequest)]
    with open(path, encoding="utf-8") as f:
        rows: list[dict[str, Any]] = [json.loads(line) for line in f if line.strip()]
    kwargs: list[dict[str, Any]] = [{k: row.get(k) for k in names} for row in rows]
    return [WorkloadRequest(**{**kw, "prompt": kw["prompt"] or ""}) for kw in kwargs]


def summarize(requests: Sequence[WorkloadRequest], block_size: int = 16) -> dict[str, Any]:
    """Counts, prompt-length stats, sessions, rounds and the ideal hit rate."""
    lens = [len(r.prompt_token_ids) for r in requests] or [0]
    return {
        "num_requests": len(requests),
        "prompt_tokens_total": sum(lens),
        "prompt_tokens_mean": round(statistics.fmean(lens), 2),
        "prompt_tokens_min": min(lens),
        "prompt_tokens_max": max(lens),
        "num_sessions": len({r.session_id for r in requests if r.session_id is not None}),
        "num_rounds": len({r.round for r in requests}),
        "block_size": block_size,
        "ideal_hit_rate": round(ideal_hit_rate(requests, block_size), 4),
    }


def _knob(text: str) -> tuple[str, float | int]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), int(value) if value.strip().lstrip("-").isdigit() else float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: not a number: {value!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: build a workload, optionally write it as JSONL, print its summary as JSON."""
    knobs = "\n".join(
        f"  {name}: " + ", ".join(f"{k}={'ceil(n/32)' if v is None else v}" for k, v in d.items())
        for name, d in DEFAULTS.items()
    )
    p = argparse.ArgumentParser(
        prog="python -m kvstack.tools.workloads",
        description="Build a deterministic synthetic workload and print its summary as JSON.",
        epilog=f"knobs (--set KNOB=VALUE; see WorkloadSpec) and their defaults:\n{knobs}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=WORKLOADS, help="workload to build")
    p.add_argument("--num-requests", type=int, default=32, help="requests in all (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of all generated text (default 0)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)"
    )
    p.add_argument("--out", default=None, help="write the requests to this JSONL file")
    p.add_argument(
        "--tokenizer",
        default="default",
        help="model name or path whose tokenizer to use (default: the default model)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="block size of ideal_hit_rate (default 16)"
    )
    p.add_argument(
        "--set",
        dest="knobs",
        type=_knob,
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="override a WorkloadSpec knob, e.g. --set shared_prefix_len=1000 (repeatable)",
    )
    args = p.parse_args(argv)
    from kvstack.model.registry import load_tokenizer

    try:
        tok = load_tokenizer(args.tokenizer)
        reqs = make_workload(
            args.name, tok, args.num_requests, args.seed, args.max_tokens, **dict(args.knobs)
        )
        if args.out:
            write_jsonl(reqs, args.out)
        print(json.dumps({"workload": args.name, **summarize(reqs, args.block_size)}, indent=2))
    except KvstackError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
