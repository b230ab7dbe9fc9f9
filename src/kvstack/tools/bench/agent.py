"""``kvstack bench serve --workload agent-loop``: live agent sessions (the client side).

The sessions are :func:`kvstack.tools.workloads.agent.agent_sessions`; here each request
is built from the server's previous reply. A turn sends the history and the user's
request with the session's tools and a forced ``tool_choice``, reads the streamed
``delta.tool_calls``, checks every call (its name is one of the tools, its arguments a
JSON object that validates against the tool's ``parameters`` with ``jsonschema``), then
appends the assistant message with those calls (the server's ids and arguments) and one
``role: tool`` message per call (the synthetic result, or an ``invalid arguments`` error
for a call that failed the check), and, with ``answer_len`` > 0, sends the answer request
(``tool_choice: "none"``) whose reply closes the turn. A call request that returns no
call (cut by ``max_tokens``) leaves its text as the assistant message and skips the
answer; a failed request ends its session. Sessions start at the arrival times of
``--request-rate`` (one arrival per session) and run concurrently, at most
``--max-concurrency`` requests in flight.

Measured besides ``bench serve``'s usual report (:mod:`.agent_report`): the share of the
prompt tokens that is tool schema, counted with the server's ``POST /tokenize``
(``messages`` + ``tools`` + ``tool_choice`` minus ``messages`` alone, on the session's
first turn) or, when the server ignores ``tools`` there, with the local tokenizer through
kvstack's own rendering; and the fraction of call requests whose calls were all valid.
TTFT of these requests is the time to their first chunk (:meth:`.stream.StreamAccumulator.fill`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import jsonschema

from kvstack.core.errors import ConfigError
from kvstack.tools.bench.agent_report import AgentStep, AgentSummary, summarize_agent
from kvstack.tools.bench.client import (
    BenchConfig,
    auth_headers,
    build_payload,
    fetch_model,
    normalize_base_url,
    send_request,
)
from kvstack.tools.bench.report import RequestResult
from kvstack.tools.bench.traffic import arrival_offsets
from kvstack.tools.workloads.agent import (
    AgentSession,
    agent_sessions,
    call_messages,
    error_result,
    render_ids,
    steps_per_turn,
    tool_result,
)
from kvstack.tools.workloads.spec import WorkloadRequest, WorkloadSpec
from kvstack.tools.workloads.text import TextMaker

if TYPE_CHECKING:
    from kvstack.model.tokenizer.tokenizer import Tokenizer

SERVER_SOURCE = "server /tokenize"
LOCAL_SOURCE = "local tokenizer (the server's /tokenize ignored tools)"


def check_call(call: dict[str, Any], tools: list[dict[str, Any]], named: str | None) -> str:
    """Why a streamed call is not valid ("" if it is): unknown or wrong tool, arguments
    that are not a JSON object or do not validate against the tool's parameters."""
    function = call.get("function") or {}
    name = function.get("name")
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if name not in schemas:
        return f"unknown tool {name!r}"
    if named is not None and name != named:
        return f"called {name!r}, tool_choice named {named!r}"
    try:
        args = json.loads(function.get("arguments") or "")
    except ValueError:
        return f"{name}: arguments are not JSON"
    if not isinstance(args, dict):
        return f"{name}: arguments are not a JSON object"
    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(schemas[name])(schemas[name]).iter_errors(args)
    )
    return "" if error is None else f"{name}: {error.message}"


def check_calls(res: RequestResult, tools: list[dict[str, Any]], named: str | None) -> list[str]:
    """One problem per call ("" = valid); ``["no tool call"]`` when there is none."""
    if not res.tool_calls:
        reason = f" (finish_reason {res.finish_reason})" if res.finish_reason else ""
        return [f"no tool call{reason}"]
    return [check_call(c, tools, named) for c in res.tool_calls]


@dataclass
class ToolTokens:
    """Counts the tool-schema tokens of a request: ``/tokenize`` with and without tools."""

    http: aiohttp.ClientSession
    base_url: str
    model: str
    headers: dict[str, str]
    tokenizer: Tokenizer | None
    source: str | None = None  # SERVER_SOURCE, LOCAL_SOURCE, or None: not counted
    _cache: dict[str, int | None] = field(default_factory=dict)

    async def _server(self, body: dict[str, Any]) -> tuple[int, bool] | None:
        """(count, whether tools were ignored) of one ``/tokenize`` call, None on failure."""
        try:
            timeout = aiohttp.ClientTimeout(total=60)
            async with self.http.post(
                self.base_url + "/tokenize", json=body, headers=self.headers, timeout=timeout
            ) as r:
                if r.status != 200:
                    return None
                ignored = r.headers.get("kvstack-ignored-fields", "").split(",")
                data = await r.json()
                return int(data["count"]), "tools" in [f.strip() for f in ignored]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
            return None

    async def count(self, sess: AgentSession, choice: str | dict[str, Any]) -> int | None:
        """Tool tokens of the session's requests with ``choice`` (cached per tool set)."""
        key = json.dumps([sess.tool_set, choice])
        if key not in self._cache:
            self._cache[key] = await self._count(sess, choice)
        return self._cache[key]

    async def _count(self, sess: AgentSession, choice: str | dict[str, Any]) -> int | None:
        msgs = [{"role": "system", "content": sess.system}]
        msgs.append({"role": "user", "content": sess.turns[0].user})
        if self.source in (None, SERVER_SOURCE):
            body = {"model": self.model, "messages": msgs}
            plain = await self._server(body)
            full = await self._server({**body, "tools": sess.tools, "tool_choice": choice})
            if plain is not None and full is not None and not full[1] and full[0] > plain[0]:
                self.source = SERVER_SOURCE
                return full[0] - plain[0]
        if self.tokenizer is None:
            return None
        self.source = LOCAL_SOURCE
        with_tools = render_ids(self.tokenizer, msgs, sess.tools, choice)
        return len(with_tools) - len(render_ids(self.tokenizer, msgs))


@dataclass
class AgentRun:
    """What :func:`run_agent_loop` returns."""

    results: list[RequestResult]
    steps: list[AgentStep]
    duration: float
    model: str
    summary: AgentSummary


class _Loop:
    """One run: the HTTP session, the schedule, and the records of every request."""

    def __init__(
        self, spec: WorkloadSpec, cfg: BenchConfig, http: aiohttp.ClientSession, model: str
    ) -> None:
        self.spec, self.cfg, self.http, self.model = spec, cfg, http, model
        self.url = normalize_base_url(cfg.base_url) + "/v1/chat/completions"
        self.headers = auth_headers(cfg.api_key)
        self.sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.records: list[tuple[RequestResult, AgentStep]] = []
        self.t0 = time.perf_counter()

    async def send(
        self,
        sess: AgentSession,
        msgs: list[dict[str, Any]],
        step: AgentStep,
        choice: str | dict[str, Any],
        max_tokens: int,
    ) -> RequestResult:
        """Send one request of a session and record it."""
        rnd = step.turn * steps_per_turn(self.spec) + (step.kind == "answer")
        rid = f"agent-loop-s{sess.index}-t{step.turn}-{step.kind}"
        extra = {"tools": sess.tools, "tool_choice": choice}
        req = WorkloadRequest(rid, [], list(msgs), "", max_tokens, sess.session_id, rnd, 0, extra)
        payload = build_payload(
            req,
            "chat",
            self.model,
            temperature=self.cfg.temperature,
            ignore_eos=self.cfg.ignore_eos and step.kind == "answer",  # a call ends by grammar
            extra_body=self.cfg.extra_body,
        )
        if self.sem is not None:
            await self.sem.acquire()
        try:
            sent = time.perf_counter()
            res = await send_request(
                self.http, self.url, payload, self.headers, req, self.cfg.timeout
            )
        finally:
            if self.sem is not None:
                self.sem.release()
        res.start_time = sent - self.t0
        self.records.append((res, step))
        return res

    async def session(
        self, sess: AgentSession, offset: float, counter: ToolTokens, maker: TextMaker
    ) -> None:
        """Run one session's turns (module docstring)."""
        await asyncio.sleep(max(0.0, self.t0 + offset - time.perf_counter()))
        spec, named = self.spec, bool(self.spec.named_tool_choice)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": sess.system}]
        for k, turn in enumerate(sess.turns):
            msgs.append({"role": "user", "content": turn.user})
            choice = sess.call_choice(k, named)
            step = AgentStep(sess.index, k, "call", await counter.count(sess, choice))
            res = await self.send(sess, msgs, step, choice, spec.max_tokens)
            if not res.success:
                return
            problems = check_calls(res, sess.tools, turn.tool if named else None)
            step.problems = [p for p in problems if p]
            pairs = [
                (c, p)
                for c, p in zip(res.tool_calls, problems, strict=False)
                if c.get("id") and c["function"].get("name")
            ]
            if not pairs:  # no call to answer: its text stays in the history
                msgs.append({"role": "assistant", "content": res.generated_text})
                continue
            calls = [c for c, _ in pairs]
            results = [
                error_result(p)
                if p
                else tool_result(spec, sess.index, k, i, c["function"]["name"], maker)
                for i, (c, p) in enumerate(pairs)
            ]
            msgs += call_messages(calls, results)
            if spec.answer_len:
                step = AgentStep(sess.index, k, "answer", await counter.count(sess, "none"))
                res = await self.send(sess, msgs, step, "none", int(spec.answer_len))
                if not res.success:
                    return
                msgs.append({"role": "assistant", "content": res.generated_text})


async def run_agent_loop(spec: WorkloadSpec, cfg: BenchConfig, tokenizer: Tokenizer) -> AgentRun:
    """Run the agent-loop sessions of ``spec`` against ``cfg``'s server (module docstring).

    Results come in session order, then the order each session sent them."""
    spec = spec.resolved()
    if spec.name != "agent-loop":
        raise ConfigError(f"run_agent_loop needs the agent-loop workload, got {spec.name!r}")
    if cfg.endpoint != "chat":
        raise ConfigError("the agent-loop workload needs --endpoint chat")
    sessions = agent_sessions(spec, tokenizer)
    offsets = arrival_offsets(len(sessions), cfg.request_rate, cfg.burstiness, cfg.seed)
    base = normalize_base_url(cfg.base_url)
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as http:
        model = cfg.model or await fetch_model(http, base, cfg)
        counter = ToolTokens(http, base, model, auth_headers(cfg.api_key), tokenizer)
        loop, maker = _Loop(spec, cfg, http, model), TextMaker(tokenizer)
        await asyncio.gather(
            *(
                loop.session(s, off, counter, maker)
                for s, off in zip(sessions, offsets, strict=True)
            )
        )
        duration = time.perf_counter() - loop.t0
    records = sorted(loop.records, key=lambda r: (r[1].session, r[0].start_time))
    results, steps = [r for r, _ in records], [s for _, s in records]
    summary = summarize_agent(spec, len(sessions), results, steps, counter.source)
    return AgentRun(results, steps, duration, model, summary)
