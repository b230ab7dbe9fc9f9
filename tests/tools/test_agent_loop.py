"""The agent-loop workload: its tool pool and knobs, the scripted JSONL form, the live
session loop against a fake server (histories built from the replies), the report, and
``kvstack bench serve --workload agent-loop`` end to end against ``kvstack serve`` on a
tiny random model (2 sessions x 2 turns)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from aiohttp import web

from kvstack.core.errors import ConfigError
from kvstack.model.loader.registry import load_tokenizer
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from kvstack.tools.bench import StreamAccumulator, main
from kvstack.tools.bench.agent import LOCAL_SOURCE, SERVER_SOURCE, check_call, run_agent_loop
from kvstack.tools.bench.agent_report import AgentStep, format_agent_report, summarize_agent
from kvstack.tools.bench.client import BenchConfig
from kvstack.tools.bench.report import RequestResult
from kvstack.tools.workloads import main as workloads_main
from kvstack.tools.workloads import make_spec, make_workload, read_jsonl, write_jsonl
from kvstack.tools.workloads.agent import render_ids
from kvstack.tools.workloads.agent_pool import TOOL_POOL
from server_util import ServerProcess, serve_aiohttp

SMALL = dict(num_turns=2, num_tools=1, tools_per_request=1, system_len=60, tool_result_len=20)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config(max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return path


@pytest.fixture(scope="module")
def tok(tiny_gguf: Path) -> Tokenizer:
    return load_tokenizer(tiny_gguf)


# ---------------------------------------------------------------- pool, knobs, JSONL form


def test_pool_examples_validate() -> None:
    assert len(TOOL_POOL) == 16 and len({t.name for t in TOOL_POOL}) == 16
    for tool in TOOL_POOL:
        for _, args in tool.examples:
            jsonschema.validate(args, tool.parameters)
        assert tool.parameters["additionalProperties"] is False


def test_knob_errors() -> None:
    bad: list[dict[str, Any]] = [
        {"num_tools": 17},
        {"tools_per_request": 9, "num_tools": 8},
        {"named_tool_choice": 2},
        {"num_sessions": 0},
        {"tools_per_request": 0},
        {"answer_len": -1},
        {"shots": 2},  # a few-shot knob
        {"bogus": 1},
    ]
    for knobs in bad:
        with pytest.raises(ConfigError):
            make_spec("agent-loop", 8, **knobs)
    spec = make_spec("agent-loop", 13)  # 3 turns x (call + answer) per session
    assert spec.num_tools == 16 and spec.tools_per_request == 8 and spec.num_turns == 3


def test_scripted_form(tok: Tokenizer, tmp_path: Path) -> None:
    reqs = make_workload("agent-loop", tok, 8, seed=1, **SMALL)
    assert reqs == make_workload("agent-loop", tok, 8, seed=1, **SMALL)
    assert [r.round for r in reqs] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.arrival_index for r in reqs] == list(range(8))
    s0 = [r for r in reqs if r.session_id == "agent-0"]
    assert [r.request_id for r in s0] == [
        f"agent-loop-s0-t{t}-{k}" for t in (0, 1) for k in ("call", "answer")
    ]
    for r in reqs:
        assert r.messages is not None and r.body_extra is not None
        extra = r.body_extra
        assert r.prompt_token_ids == render_ids(
            tok, r.messages, extra["tools"], extra["tool_choice"]
        )
        assert extra["tool_choice"] == ("required" if r.request_id.endswith("call") else "none")
    answer = s0[1].messages or []
    assert answer[-2]["tool_calls"][0]["id"] == "call_s0_t0" == answer[-1]["tool_call_id"]
    # The history grows behind the same system prompt and tools.
    assert s0[2].prompt_token_ids[: len(s0[0].prompt_token_ids)] == s0[0].prompt_token_ids
    path = tmp_path / "agent.jsonl"
    write_jsonl(reqs, path)
    assert read_jsonl(path) == reqs
    row = json.loads(path.read_text().splitlines()[0])
    assert (
        row["body"]["tools"] == reqs[0].body_extra["tools"] and row["body"]["ignore_eos"] is False
    )


def test_workloads_cli(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.jsonl"
    argv = ["agent-loop", "--tokenizer", str(tiny_gguf), "--num-requests", "4", "--out", str(out)]
    assert workloads_main([*argv, "--set", "num_turns=1"]) == 0
    assert json.loads(capsys.readouterr().out)["num_sessions"] == 2 and len(read_jsonl(out)) == 4
    assert workloads_main([*argv, "--set", "num_tools=99"]) == 2
    err = capsys.readouterr().err.strip()
    assert "num_tools must be <= 16" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------- checks, stream, report


def test_check_call() -> None:
    tools = [TOOL_POOL[0].schema]  # get_weather

    def call(name: str, args: str) -> dict[str, Any]:
        return {"id": "c", "type": "function", "function": {"name": name, "arguments": args}}

    assert check_call(call("get_weather", '{"city": "Oslo", "days": 2}'), tools, None) == ""
    assert "unknown tool" in check_call(call("run_sql", "{}"), tools, None)
    assert "not JSON" in check_call(call("get_weather", '{"city": '), tools, None)
    assert "not a JSON object" in check_call(call("get_weather", "[1]"), tools, None)
    assert "'city' is a required" in check_call(call("get_weather", '{"days": 2}'), tools, None)
    assert "maximum" in check_call(call("get_weather", '{"city": "a", "days": 9}'), tools, None)
    assert "tool_choice named" in check_call(call("get_weather", '{"city": "a"}'), tools, "x")


def test_stream_folds_tool_call_deltas() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n".encode()

    acc = StreamAccumulator()
    acc.feed(chunk({"role": "assistant", "content": ""}), 1.0)
    acc.feed(chunk({}), 2.0)
    head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    acc.feed(
        chunk({"tool_calls": [head, {"index": 1, "id": "call_2", "function": {"name": "g"}}]}), 3.0
    )
    acc.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}), 4.0)
    acc.feed(
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, "tool_calls"), 5.0
    )
    acc.feed(b"data: [DONE]\n\n", 6.0)
    res = RequestResult(success=True, latency=5.5)
    acc.fill(res, start=0.5, every_chunk=True)
    assert [c["id"] for c in res.tool_calls] == ["call_1", "call_2"]
    assert res.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert res.finish_reason == "tool_calls" and res.ttft == 0.5 and res.itl == [1.0] * 4
    plain = RequestResult(success=True, latency=5.5)
    acc.fill(plain, start=0.5)  # text chunks: the tool_calls deltas count as output
    assert plain.ttft == 2.5 and plain.num_chunks == 3


def test_summary_by_hand() -> None:
    spec = make_spec("agent-loop", 4, **SMALL)

    def res(prompt: int, cached: int, ttft: float) -> RequestResult:
        return RequestResult(success=True, prompt_tokens=prompt, cached_tokens=cached, ttft=ttft)

    results = [res(100, 0, 0.2), res(150, 96, 0.1), res(200, 144, 0.1), res(250, 192, 0.05)]
    steps = [
        AgentStep(0, 0, "call", 60),
        AgentStep(0, 0, "answer", 60),
        AgentStep(0, 1, "call", 60, ["no tool call (finish_reason length)"]),
        AgentStep(0, 1, "answer", None),
    ]
    s = summarize_agent(spec, 1, results, steps, SERVER_SOURCE)
    assert (s.call_requests, s.valid_calls, s.valid_call_rate) == (2, 1, 0.5)
    assert s.tool_schema_share == pytest.approx(180 / 450) and s.tool_tokens_mean == 60
    assert s.hit_rate_later_turns == pytest.approx(336 / 450)
    assert s.hit_rate_by_kind["call"] == pytest.approx(144 / 300)
    assert s.ttft_ms_by_kind["call"]["median"] == pytest.approx(150.0)
    assert s.requests_planned == 4 and s.problems == ["no tool call (finish_reason length)"]
    text = format_agent_report(s)
    assert "Valid tool calls (%):" in text and "50.00 (1 of 2)" in text and "40.00" in text


# ---------------------------------------------------------------- the loop, fake server


@dataclass
class Fake:
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    ignore_tools: bool = False  # /tokenize as a server that does not know tools


def fake_app(state: Fake) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        n = len(json.dumps(body["messages"]))
        n += 100 if "tools" in body and not state.ignore_tools else 0
        headers = (
            {"kvstack-ignored-fields": "tools,tool_choice"}
            if state.ignore_tools and "tools" in body
            else {}
        )
        return web.json_response({"count": n}, headers=headers)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
            obj = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        n = len(state.bodies)
        if body["tool_choice"] == "none":
            await send({"content": f"answer {n}"}, "stop")
        else:
            args = '{"city": "Oslo"}' if n == 1 else '{"city": 5}'  # the 2nd call is invalid
            call = {"index": 0, "id": f"call_{n}", "type": "function",
                    "function": {"name": "get_weather", "arguments": args}}  # fmt: skip
            await send({"tool_calls": [call]}, "tool_calls")
        usage = {"prompt_tokens": 1000 * n, "completion_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 0 if n == 1 else 900}}  # fmt: skip
        await resp.write(
            f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
        )
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@contextmanager
def fake_server(state: Fake) -> Iterator[Fake]:
    with serve_aiohttp(fake_app(state)) as url:
        state.url = url
        yield state


@pytest.mark.parametrize("ignore_tools", [False, True])
def test_loop_builds_each_request_from_the_reply(tok: Tokenizer, ignore_tools: bool) -> None:
    spec = make_spec("agent-loop", 4, num_sessions=1, named_tool_choice=1, **SMALL)
    with fake_server(Fake(ignore_tools=ignore_tools)) as fake:
        run = asyncio.run(run_agent_loop(spec, BenchConfig(base_url=fake.url), tok))
    b = fake.bodies
    assert [x["tool_choice"] for x in b] == [
        {"type": "function", "function": {"name": "get_weather"}},
        "none",
    ] * 2
    assert "ignore_eos" not in b[0] and b[1]["ignore_eos"] is True
    call_msg, result_msg = b[1]["messages"][-2:]
    assert call_msg["tool_calls"][0]["id"] == "call_1" == result_msg["tool_call_id"]
    assert json.loads(result_msg["content"])["status"] == "ok"
    assert b[2]["messages"][-2:] == [
        {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": b[2]["messages"][-1]["content"]},
    ]
    assert b[2]["messages"][: len(b[1]["messages"])] == b[1]["messages"]
    bad = b[3]["messages"][-1]
    assert bad["tool_call_id"] == "call_3" and "invalid arguments" in bad["content"]
    s = run.summary
    assert (s.requests_sent, s.call_requests, s.valid_calls) == (4, 2, 1)
    assert s.tool_tokens_source == (LOCAL_SOURCE if ignore_tools else SERVER_SOURCE)
    assert s.tool_schema_share is not None and 0 < s.tool_schema_share < 1
    assert s.hit_rate_later_turns == pytest.approx(1800 / 7000)


def test_bench_cli_bad_input(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        "--workload",
        "agent-loop",
        "--tokenizer",
        str(tiny_gguf),
        "--base-url",
        "http://127.0.0.1:9",
    ]
    for extra, needle in [
        (["--set", "num_tools=17"], "num_tools must be <= 16"),
        (["--set", "shots=2"], "does not apply to workload 'agent-loop'"),
        (["--num-prompts", "4", "--set", "num_sessions=2"], "not both"),
        (["--endpoint", "completions"], "needs --endpoint chat"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------- end to end, kvstack serve


def test_agent_loop_against_kvstack_serve(tiny_gguf: Path, tmp_path: Path) -> None:
    args = [
        "--model",
        str(tiny_gguf),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--num-blocks",
        "512",
    ]
    with ServerProcess(args, tmp_path / "server.log") as srv:
        # /tokenize renders tools as a chat completion does.
        msgs = [{"role": "user", "content": "Weather in Oslo?"}]
        tools = [TOOL_POOL[0].schema]
        body = {"messages": msgs, "tools": tools, "tool_choice": "required"}
        n = httpx.post(srv.url + "/tokenize", json=body).json()["count"]
        chat = httpx.post(
            srv.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60
        )
        assert chat.json()["usage"]["prompt_tokens"] == n
        assert n > httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()["count"]
        bad = httpx.post(srv.url + "/tokenize", json={"prompt": "x", "tools": tools})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"

        argv = ["--base-url", srv.url, "--workload", "agent-loop", "--tokenizer", str(tiny_gguf)]
        argv += [
            f"--set={k}={v}"
            for k, v in {
                **SMALL,
                "num_sessions": 2,
                "named_tool_choice": 1,
                "answer_len": 8,
            }.items()
        ]
        # Sampled (seeded) rather than greedy: a random model's greedy output repeats one
        # token until max_tokens. Its strings may run to max_tokens (a cut call is
        # invalid), so the figures below hold whatever the share of valid calls.
        argv += ["--max-tokens", "48", "--temperature", "1", "--extra-body", '{"seed": 2}']
        argv += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
        assert main(argv) == 0
        # The scripted JSONL form replays through the generic path (--dataset).
        jsonl = tmp_path / "agent.jsonl"
        write_jsonl(make_workload("agent-loop", load_tokenizer(tiny_gguf), 4, **SMALL), jsonl)
        replay = ["--base-url", srv.url, "--dataset", str(jsonl), "--max-tokens", "8"]
        replay += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "d.json"]
        assert main(replay) == 0
    rep = json.loads((tmp_path / "d.json").read_text())
    assert rep["completed"] == 4 and all(t is not None for t in rep["ttfts"])
    assert rep["cached_tokens"][-1] > 0
    res = json.loads((tmp_path / "r.json").read_text())
    agent, steps = res["agent"], res["agent_steps"]
    assert res["failed"] == 0 and res["completed"] == agent["requests_sent"] == len(steps)
    for key in ("cache_hit_rate", "median_ttft_ms", "p90_ttft_ms", "output_throughput"):
        assert isinstance(res[key], float) and res[key] > 0, key
    assert agent["tool_tokens_source"] == SERVER_SOURCE and 0 < agent["tool_schema_share"] < 1
    assert agent["call_requests"] == 4 and 0 <= agent["valid_call_rate"] <= 1
    later = [c for c, s in zip(res["cached_tokens"], steps, strict=True) if s["turn"] > 0]
    assert later and all(c > 0 for c in later)
    # Each valid call was answered (an answer request with its tool result in the history).
    answered = sum(s["kind"] == "answer" for s in steps)
    assert answered >= agent["valid_calls"] >= 0
    for calls, step in zip(res["tool_calls"], steps, strict=True):
        if step["kind"] == "call" and not step["problems"]:
            for c in calls:
                jsonschema.validate(json.loads(c["function"]["arguments"]), TOOL_POOL[0].parameters)
