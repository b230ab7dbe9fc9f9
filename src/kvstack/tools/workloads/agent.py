"""The agent-loop workload: sessions that call tools, send the results back, and go on.

A session is a system prompt (shared by all sessions) and a set of tools, then
``num_turns`` turns. Each turn is a user request for one of the session's tools (an
example task of :data:`~.agent_pool.TOOL_POOL`), a **call request** whose ``tool_choice``
forces a call (``"required"``, or the turn's tool by name with ``named_tool_choice=1``),
the call and its synthetic result (an assistant message with ``tool_calls`` and one
``role: tool`` message per call, with the call's id), and, when ``answer_len`` > 0, an
**answer request** (``tool_choice: "none"``, at most ``answer_len`` tokens) whose reply
closes the turn. Every request carries the tools, so the history grows turn by turn
behind the same system prompt and tools: a prefix cache serves all of it but the newest
messages. Layout (``T`` = tools, ``u`` user, ``c`` call, ``r`` result, ``a`` answer)::

    |H=system=|==T (tools_per_request of them)==|u0|c0|r0|a0|u1|c1|r1|a1|u2 ...

Tool sets: ``num_tool_sets`` (default: one per session) subsets of ``tools_per_request``
tools drawn from the first ``num_tools`` of the pool, each in an order fixed by the seed;
session ``s`` uses set ``s % num_tool_sets``.

**Two forms.** ``kvstack bench serve --workload agent-loop`` runs the sessions live
(:mod:`kvstack.tools.bench.agent`): each request is built from the server's previous
reply (its call ids and arguments), which a file cannot express. The requests of
:func:`agent_loop_requests` (``python -m kvstack.tools.workloads agent-loop``, JSONL) are
the same sessions with *scripted* calls instead: the ideal call of each task (the pool's
example arguments, ids ``call_s<session>_t<turn>``) and a scripted answer text, so a
replay (``bench serve --dataset``) sends histories that do not depend on what the server
answered, as the other multi-turn workloads do. ``round`` is the step in the session (call
of turn k = round 2k, its answer 2k + 1; k without answers).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstack.tools.workloads.agent_pool import TOOL_POOL, PoolTool
from kvstack.tools.workloads.spec import WorkloadRequest, WorkloadSpec
from kvstack.tools.workloads.text import NOUNS, TextMaker

if TYPE_CHECKING:
    from kvstack.model.tokenizer.tokenizer import Tokenizer

SYSTEM_LEAD = (
    "You are the operations assistant of a small company. You act through the tools you "
    "are given: call the tool that fits the request, then report the result to the user "
    "in one or two sentences."
)
_NUMERIC = ("temperature", "wind_kph", "price", "change_pct", "rate", "converted", "row_count")
_COUNTS = ("total_hits", "total_lines", "total_results", "distance_km", "duration_min")


def _n(value: int | float | None) -> int:
    assert value is not None, "use WorkloadSpec.resolved() first"
    return int(value)


def _rng(spec: WorkloadSpec, *parts: object) -> random.Random:
    return random.Random("/".join(map(str, (spec.seed, spec.name, *parts))))


@dataclass(frozen=True)
class AgentTurn:
    """One user turn: its text and the tool (and ideal arguments) the task is for."""

    user: str
    tool: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class AgentSession:
    """One session: its tools (OpenAI ``tools``, in the set's order) and its turns."""

    index: int
    session_id: str
    tool_set: int
    system: str
    tools: list[dict[str, Any]]
    turns: list[AgentTurn]

    def call_choice(self, turn: int, named: bool) -> str | dict[str, Any]:
        """``tool_choice`` of turn ``turn``'s call request."""
        if not named:
            return "required"
        return {"type": "function", "function": {"name": self.turns[turn].tool}}


def steps_per_turn(spec: WorkloadSpec) -> int:
    """Requests per turn: the call, and the answer when ``answer_len`` > 0."""
    return 2 if _n(spec.answer_len) > 0 else 1


def num_sessions(spec: WorkloadSpec) -> int:
    """``num_sessions``, or enough whole sessions for ``num_requests`` (rounded up)."""
    if spec.num_sessions is not None:
        return int(spec.num_sessions)
    per_session = _n(spec.num_turns) * steps_per_turn(spec)
    return max(1, math.ceil(spec.num_requests / per_session))


def tool_sets(spec: WorkloadSpec) -> list[list[PoolTool]]:
    """The seeded tool subsets (each in its own fixed order)."""
    pool, k = TOOL_POOL[: _n(spec.num_tools)], _n(spec.tools_per_request)
    count = _n(spec.num_tool_sets) if spec.num_tool_sets is not None else num_sessions(spec)
    return [_rng(spec, "toolset", i).sample(pool, k) for i in range(count)]


def agent_sessions(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[AgentSession]:
    """The sessions of a resolved ``agent-loop`` spec (same seed, same sessions)."""
    maker = TextMaker(tokenizer)
    system = maker.text(_rng(spec, "system"), _n(spec.system_len), SYSTEM_LEAD)
    sets = tool_sets(spec)
    out = []
    for s in range(num_sessions(spec)):
        rng, tools = _rng(spec, "session", s), sets[s % len(sets)]
        turns = []
        for _ in range(_n(spec.num_turns)):
            tool = rng.choice(tools)
            text, args = rng.choice(tool.examples)
            if _n(spec.user_len) > maker.count(text):
                text = maker.text(rng, _n(spec.user_len), text + " Some context:")
            turns.append(AgentTurn(text, tool.name, dict(args)))
        schemas = [t.schema for t in tools]
        out.append(AgentSession(s, f"agent-{s}", s % len(sets), system, schemas, turns))
    return out


def tool_result(
    spec: WorkloadSpec, session: int, turn: int, call: int, name: str, maker: TextMaker
) -> str:
    """The synthetic result (JSON text) of call ``call`` of a turn: ``status`` ok, the
    tool's result fields with seeded values and ``notes`` of about ``tool_result_len``
    tokens."""
    rng = _rng(spec, "result", session, turn, call)
    tool = next(t for t in TOOL_POOL if t.name == name)
    out: dict[str, Any] = {"status": "ok"}
    for field in tool.result_fields:
        if field in _NUMERIC:
            out[field] = round(rng.uniform(1.0, 500.0), 2)
        elif field in _COUNTS:
            out[field] = rng.randint(1, 900)
        elif field.endswith("_id"):
            out[field] = f"{field[:3]}-{rng.randint(100000, 999999)}"
        elif field.endswith("s"):
            out[field] = [maker.sentence(rng) for _ in range(2)]
        else:
            out[field] = rng.choice(NOUNS)
    if _n(spec.tool_result_len) > 0:
        out["notes"] = maker.text(rng, _n(spec.tool_result_len))
    return json.dumps(out, ensure_ascii=False)


def error_result(problem: str) -> str:
    """What the client answers a call whose arguments do not match the tool's schema."""
    return json.dumps({"status": "error", "error": f"invalid arguments: {problem}"})


def call_messages(calls: list[dict[str, Any]], results: list[str]) -> list[dict[str, Any]]:
    """The assistant message with ``calls`` (OpenAI ``tool_calls``) and one tool message
    per call, with its id and result."""
    out: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": calls}]
    for call, result in zip(calls, results, strict=True):
        out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return out


def parse_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> tuple[list[Any], Any]:
    """A chat body's messages and tool plan as ``kvstack serve`` parses them."""
    from kvstack.serve.api.protocol_tools import NamedToolChoice, ToolDef
    from kvstack.serve.chat.messages import ChatMessage
    from kvstack.serve.chat.tool_calls import ToolPlan

    choice: Any = tool_choice
    if isinstance(tool_choice, dict):
        choice = NamedToolChoice.model_validate(tool_choice)
    defs = [ToolDef.model_validate(t) for t in tools] if tools else None
    plan = ToolPlan.build(defs, choice, None, "hermes")
    return [ChatMessage.model_validate(m) for m in messages], plan


def render_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a chat request exactly as ``kvstack serve`` renders it with this
    tokenizer: the template's tool section, or the fallback in the system prompt."""
    from kvstack.serve.chat.prompt import chat_prompt_ids

    msgs, plan = parse_chat(messages, tools, tool_choice)
    return chat_prompt_ids(tokenizer, msgs, add_generation_prompt=True, plan=plan)


def _scripted(
    spec: WorkloadSpec,
    tokenizer: Tokenizer,
    sess: AgentSession,
    msgs: list[dict[str, Any]],
    step: tuple[str, int],
    choice: str | dict[str, Any],
    max_tokens: int,
) -> WorkloadRequest:
    """One request of the scripted form: ``step`` is (``"call"`` or ``"answer"``, round)."""
    kind, rnd = step
    ids = render_ids(tokenizer, msgs, sess.tools, choice)
    extra: dict[str, Any] = {"tools": sess.tools, "tool_choice": choice}
    if kind == "call":
        extra["ignore_eos"] = False  # a forced call ends where its grammar does
    rid = f"agent-loop-s{sess.index}-t{rnd // steps_per_turn(spec)}-{kind}"
    text = tokenizer.decode(ids, skip_special_tokens=False)
    copy = json.loads(json.dumps(msgs))
    return WorkloadRequest(rid, ids, copy, text, max_tokens, sess.session_id, rnd, 0, extra)


def agent_loop_requests(spec: WorkloadSpec, tokenizer: Tokenizer) -> list[WorkloadRequest]:
    """The scripted form (module docstring), in arrival order: round-major over sessions."""
    maker, named = TextMaker(tokenizer), bool(spec.named_tool_choice)
    answer_len = _n(spec.answer_len)
    items: list[tuple[int, int, WorkloadRequest]] = []
    for sess in agent_sessions(spec, tokenizer):
        msgs: list[dict[str, Any]] = [{"role": "system", "content": sess.system}]
        rng = _rng(spec, "answers", sess.index)
        for k, turn in enumerate(sess.turns):
            rnd = k * steps_per_turn(spec)
            msgs.append({"role": "user", "content": turn.user})
            choice = sess.call_choice(k, named)
            req = _scripted(spec, tokenizer, sess, msgs, ("call", rnd), choice, spec.max_tokens)
            items.append((rnd, sess.index, req))
            call = {
                "id": f"call_s{sess.index}_t{k}",
                "type": "function",
                "function": {"name": turn.tool, "arguments": json.dumps(turn.arguments)},
            }
            msgs += call_messages([call], [tool_result(spec, sess.index, k, 0, turn.tool, maker)])
            if answer_len > 0:
                req = _scripted(
                    spec, tokenizer, sess, msgs, ("answer", rnd + 1), "none", answer_len
                )
                items.append((rnd + 1, sess.index, req))
                answer = maker.text(rng, answer_len, "Done: here is what I found.")
                msgs.append({"role": "assistant", "content": answer})
    items.sort(key=lambda item: item[:2])
    return [dataclasses.replace(r, arrival_index=i) for i, (_, _, r) in enumerate(items)]
