"""``kvstack bench serve`` end to end: the async client and the command line against a
small aiohttp server started here (no model), failures, and ``python -m``."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from bench_serve_util import parse, wreq
from kvstack.core.errors import ConfigError
from kvstack.tools.bench.cli import run_bench_serve
from kvstack.tools.workloads import write_jsonl
from server_util import serve_aiohttp


@dataclass
class ServerState:
    url: str = ""
    log: list[dict[str, Any]] = field(default_factory=list)


def make_app(state: ServerState, chunk_delay: float = 0.002) -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        text = json.dumps(body["messages"]) if chat else body["prompt"]
        entry = {"body": body, "auth": request.headers.get("Authorization"), "start": start}
        state.log.append(entry)
        if "FAIL" in text:
            entry["end"] = time.perf_counter()
            err = {"error": {"message": "internal failure", "type": "server_error", "code": 500}}
            return web.json_response(err, status=500)
        if "SLOW" in text:
            await asyncio.sleep(0.6)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def choice(piece: str, finish: str | None = None) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish}
            c.update({"delta": {"content": piece}} if chat else {"text": piece})
            return {"choices": [c]}

        await send(choice(""))
        await resp.write(b": ping\n\n")
        n = int(body["max_tokens"])
        for i in range(n):
            await asyncio.sleep(chunk_delay)
            await send(choice(f" w{i}", "length" if i == n - 1 else None))
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
        usage["prompt_tokens_details"] = {"cached_tokens": 4}  # type: ignore[assignment]
        await send({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        entry["end"] = time.perf_counter()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    return app


@contextmanager
def fake_server() -> Iterator[ServerState]:
    """An aiohttp app on a free 127.0.0.1 port, served by its own loop in a thread."""
    state = ServerState()
    with serve_aiohttp(make_app(state)) as url:
        state.url = url
        yield state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_end_to_end_chat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = [wreq(i, "FAIL please" if i in (2, 5) else f"question {i}") for i in range(10)]
    write_jsonl(reqs, tmp_path / "work.jsonl")
    with fake_server() as server:
        args = parse(
            [
                "--base-url", server.url + "/v1",
                "--dataset", str(tmp_path / "work.jsonl"),
                "--api-key", "sk-test",
                "--request-rate", "200", "--max-concurrency", "4",
                "--goodput", "ttft:5000", "e2el:10000",
                "--save-result", "--result-dir", str(tmp_path / "out"),
                "--result-filename", "res.json", "--label", "fake", "--disable-tqdm",
            ]
        )  # fmt: skip
        assert run_bench_serve(args) == 0
    out = capsys.readouterr().out
    print(out)
    assert "Serving Benchmark Result" in out and "internal failure" in out
    assert len(server.log) == 10
    body = server.log[0]["body"]
    assert body["model"] == "fake-model" and body["ignore_eos"] is True and body["stream"]
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    assert server.log[0]["auth"] == "Bearer sk-test"
    res = json.loads((tmp_path / "out" / "res.json").read_text())
    assert (res["completed"], res["failed"]) == (8, 2)
    assert res["errors"][2].startswith("HTTP 500: internal failure") and res["errors"][0] == ""
    assert res["total_output_tokens"] == 8 * 4 and res["output_lens"][2] == 0
    assert res["total_input_tokens"] == 80 and res["cached_prompt_tokens"] == 32
    assert res["cache_hit_rate"] == pytest.approx(0.4)
    assert res["request_goodput"] > 0 and res["label"] == "fake"
    assert res["model_id"] == "fake-model" and "api_key" not in res["settings"]
    assert 1 <= res["max_concurrency_observed"] <= 4
    assert len(res["itls"][0]) == 3 and res["ttfts"][0] > 0
    assert res["generated_texts"][0] == " w0 w1 w2 w3"
    assert res["request_rate"] == 200.0 and res["p99_e2el_ms"] > 0


def test_end_to_end_multi_turn_completions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real multi-turn workload (default tokenizer) on /v1/completions: the turns of
    each conversation are sent in order, each after the previous one finished."""
    with fake_server() as server:
        args = parse(
            [
                "--base-url", server.url, "--endpoint", "completions",
                "--workload", "multi-turn", "--num-prompts", "10", "--max-tokens", "3",
                "--set", "system_len=40", "--no-ignore-eos", "--disable-tqdm",
                "--save-result", "--result-dir", str(tmp_path),
            ]
        )  # fmt: skip
        assert run_bench_serve(args) == 0
    out = capsys.readouterr().out
    assert "Failed requests:                         0" in out
    for e in server.log:
        assert "prompt" in e["body"] and "ignore_eos" not in e["body"] and e["auth"] is None
    assert len(server.log) == 10
    (path,) = tmp_path.glob("bench-serve-multi-turn-inf-*.json")
    res = json.loads(path.read_text())
    assert res["completed"] == 10 and sorted(set(res["rounds"])) == [0, 1, 2, 3, 4]
    by_session: dict[str, list[tuple[int, float, float]]] = {}
    for sid, rnd, start, e2el in zip(
        res["session_ids"], res["rounds"], res["start_times"], res["e2els"], strict=True
    ):
        by_session.setdefault(sid, []).append((rnd, start, start + e2el))
    assert len(by_session) == 2
    for turns in by_session.values():
        turns.sort()
        for (_, _, end), (_, start, _) in itertools.pairwise(turns):
            assert start >= end


def test_failures_never_crash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reqs = [wreq(0, "SLOW one"), wreq(1, "fine")]
    write_jsonl(reqs, tmp_path / "w.jsonl")
    with fake_server() as server:
        args = parse(
            ["--base-url", server.url, "--dataset", str(tmp_path / "w.jsonl"), "--timeout", "0.2",
             "--disable-tqdm", "--plot", str(tmp_path / "p.png")]
        )  # fmt: skip
        assert run_bench_serve(args) == 0
    out = capsys.readouterr().out
    assert "Failed requests:                         1" in out and "timeout after 0.2 s" in out
    if "cannot plot" not in out:
        assert (tmp_path / "p.png").exists()

    dead = f"http://127.0.0.1:{free_port()}"
    args = parse(["--base-url", dead, "--dataset", str(tmp_path / "w.jsonl"), "--disable-tqdm"])
    with pytest.raises(ConfigError, match="is the server up"):
        run_bench_serve(args)
    args = parse(
        ["--base-url", dead, "--dataset", str(tmp_path / "w.jsonl"), "--model", "m",
         "--disable-tqdm"]
    )  # fmt: skip
    assert run_bench_serve(args) == 1
    out = capsys.readouterr().out
    assert "Successful requests:                     0" in out
    assert "Failed requests:                         2" in out and "ClientConnectorError" in out


def test_python_m_help() -> None:
    """``python -m kvstack.tools.bench --help``: the package's ``__main__`` runs."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstack.tools.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m kvstack.tools.bench")
    assert "--request-rate" in out
