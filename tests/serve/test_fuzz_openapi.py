"""Schemathesis against the server's own ``/openapi.json`` (the fault suite): bounded, on a tiny
random model served by uvicorn on loopback, with no API key (so every body reaches the
validators). No case may get a 5xx: bad input is a 4xx because it is validated, and an
internal error stays a 500 (``http_errors._internal``), so a bug the fuzz reaches fails
here instead of hiding in a catch-all. ``kvstack:internal_errors_total`` must stay 0.

Bounded: at most ``EXAMPLES`` cases per operation (about 300 in all; hypothesis stops
earlier on an operation with few distinct inputs), ``max_model_len`` 64 so no
generation runs long, ``derandomize`` so a run is reproducible. ``/v1/kv_events`` and
``/v1/kv/state`` are left out: they stream until the client leaves.

``test_edge_values_reach_no_5xx_and_no_failed_step`` adds what the schema cannot
describe: every numeric sampling field at float32's edges (subnormals, 1e-320, past
float32's max, 2**70, NaN, 1e999, integer literals past 4,300 digits) and strings with
lone surrogates; each 4xx must name its ``param`` (``EDGE_EXAMPLES`` cases, ~7 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from kvstack import LLM
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.metrics.server import ServerMetrics
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf
from server_util import free_port

EXAMPLES = 40
EDGE_EXAMPLES = 600  # edge_requests cases (test_edge_values_reach_no_5xx_and_no_failed_step)


class Fuzzed:
    def __init__(self, url: str, engine: AsyncEngine, llm: LLM) -> None:
        self.url, self.engine, self.llm = url, engine, llm
        self.http = httpx.Client(base_url=url, timeout=120)
        self.cases = 0


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    llm = LLM(str(path), dtype="float32", num_blocks=256, max_model_len=64)
    engine = AsyncEngine(llm.engine, metrics=ServerMetrics("tiny"), max_waiting=64)
    app = create_app(engine, ServerConfig(model_name="tiny", request_timeout_s=60))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
        assert thread.is_alive(), "server failed to start"
    f = Fuzzed(f"http://127.0.0.1:{port}", engine, llm)
    yield f
    metrics = f.http.get("/metrics").text
    server.should_exit = True
    thread.join(30)
    assert f.cases >= 200, f"only {f.cases} cases ran"
    assert "kvstack:internal_errors_total" not in metrics or all(
        line.endswith(" 0.0")
        for line in metrics.splitlines()
        if line.startswith("kvstack:internal_errors_total")
    ), metrics
    assert engine.num_active == 0
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    llm.engine.kv_manager.check_integrity()


def strategies(document: dict[str, Any]) -> list[tuple[str, st.SearchStrategy[Any]]]:
    """Each operation's cases: valid ones and (where the schema allows any) invalid ones."""
    streams = ["/v1/kv_events", "/v1/kv/state"]
    schema = schemathesis.openapi.from_dict(document).exclude(path=streams)
    out = []
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [op.as_strategy(GenerationMode.POSITIVE)]
        with contextlib.suppress(Exception):  # an operation with nothing to make invalid
            modes.append(op.as_strategy(GenerationMode.NEGATIVE))
        out.append((op.label, st.one_of(modes)))
    return out


def test_no_input_reaches_a_5xx(fuzzed: Fuzzed) -> None:
    ops = strategies(fuzzed.http.get("/openapi.json").json())
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize"} <= {
        label for label, _ in ops
    }
    for _label, cases in ops:

        @given(case=cases)
        @settings(
            max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        def run(case: Any) -> None:
            fuzzed.cases += 1
            response = case.call(base_url=fuzzed.url, timeout=120)
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
            )
            if response.status_code >= 400 and "json" in response.headers.get("content-type", ""):
                error = response.json()["error"]  # every error is an OpenAI error object
                assert error["message"] and error["type"], error

        run()


# ------------------------------------------------ sampling fields at float32's edges
F32_TINY, F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38
FLOAT_EDGES = [0.0, 5e-324, 1e-320, 1e-46, 1e-45, F32_TINY, 1e-7, 1e-5, 0.5, 0.9999999,
               1.0, 1.0000001, 2.0, 100.0, F32_MAX, 3.5e38, 1e39, 1e308]  # fmt: skip
VALID_EDGES = [5e-324, 1e-320, 1e-46, 1e-45, F32_TINY, 1e-5, 0.9999999, 1.0]
INT_EDGES = [0, 1, 2, 16, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, 2**70]
# Literals json.dumps cannot write, spliced into the text (see ``body_text``).
RAW = {"@NAN": "NaN", "@INF": "Infinity", "@NINF": "-Infinity", "@HUGE": "1e999",
       "@LONG": "9" * 4301, "@NLONG": "-" + "9" * 4301}  # fmt: skip
SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "max_tokens", "n", "seed",
                   "min_tokens", "prompt_logprobs", "truncate_prompt_tokens", "kv_press_ratio",
                   "max_completion_tokens"]  # fmt: skip


def edge_numbers() -> st.SearchStrategy[Any]:
    """Float32 edges (subnormals, 1e-320, around 1, past float32's max), their negatives,
    int64 and 2**70 edges, any float or int, and the literals of ``RAW``."""
    floats = st.sampled_from(FLOAT_EDGES).flatmap(lambda x: st.sampled_from([x, -x]))
    ints = st.sampled_from(INT_EDGES).flatmap(lambda x: st.sampled_from([x, -x, x - 1]))
    return st.one_of(floats, ints, st.floats(allow_nan=False, allow_infinity=False),
                     st.integers(), st.sampled_from(sorted(RAW)))  # fmt: skip


def edge_text() -> st.SearchStrategy[str]:
    """Short text, often with a lone surrogate (escaped ``\\ud800`` by json.dumps)."""
    lone = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    return st.one_of(st.text(max_size=6), st.lists(st.one_of(lone, st.characters()),
                     min_size=1, max_size=4).map("".join))  # fmt: skip


def token_ids() -> st.SearchStrategy[list[Any]]:
    return st.lists(st.one_of(st.integers(0, 300), edge_numbers()), min_size=1, max_size=20)


@st.composite
def edge_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A (path, body): a completion, chat, tokenize or unpin request whose sampling fields
    (a few, each an edge number), prompt, strings and token ids come from the edges."""
    fields = draw(st.lists(st.sampled_from(SAMPLING_FIELDS), max_size=4, unique=True))
    body: dict[str, Any] = {"max_tokens": draw(st.sampled_from([1, 2, 4]))}
    valid = st.sampled_from(VALID_EDGES)  # accepted by every float field: must be a 2xx
    body |= {f: draw(st.one_of(valid, edge_numbers())) for f in fields}
    extras = {"logit_bias": st.dictionaries(st.one_of(edge_text(), st.integers().map(str)),
                                            edge_numbers(), max_size=2),
              "stop_token_ids": token_ids(), "allowed_token_ids": token_ids(),
              "bad_words": st.lists(edge_text(), max_size=2), "stop": edge_text(),
              "cache_salt": edge_text(), "model": edge_text()}  # fmt: skip
    for name in draw(st.lists(st.sampled_from(sorted(extras)), max_size=2, unique=True)):
        body[name] = draw(extras[name])
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize",
                                 "/v1/cache/unpin"]))  # fmt: skip
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": draw(edge_text()) or "x"}]
        if draw(st.booleans()):
            body["logprobs"], body["top_logprobs"] = True, draw(edge_numbers())
    elif path == "/v1/completions":
        body["prompt"] = draw(st.one_of(edge_text(), token_ids()))
        if draw(st.booleans()):
            body["logprobs"] = draw(edge_numbers())
    else:  # ops bodies take a prompt (and cache_salt, model) only
        body = {"prompt": draw(st.one_of(edge_text(), token_ids()))}
    return path, body


def body_text(body: dict[str, Any]) -> bytes:
    """``body`` as JSON; each ``RAW`` placeholder string becomes its raw literal."""
    text = json.dumps(body)
    for key, literal in RAW.items():
        text = text.replace(f'"{key}"', literal)
    return text.encode()


def test_edge_values_reach_no_5xx_and_no_failed_step(fuzzed: Fuzzed) -> None:
    """Every numeric sampling field at float32's edges, lone surrogates, integers past
    2**64 and past 4,300 digits: a 2xx, or a 4xx naming its ``param``; never a 5xx, and
    no failed engine step (``internal_errors_total`` is checked by the fixture)."""
    counts = {"cases": 0, "2xx": 0, "4xx": 0, "5xx": 0}

    @given(case=edge_requests())
    @settings(
        max_examples=EDGE_EXAMPLES, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    def run(case: tuple[str, dict[str, Any]]) -> None:
        path, body = case
        fuzzed.cases += 1
        counts["cases"] += 1
        r = fuzzed.http.post(path, content=body_text(body),
                             headers={"content-type": "application/json"})  # fmt: skip
        counts[f"{r.status_code // 100}xx"] = counts.get(f"{r.status_code // 100}xx", 0) + 1
        assert r.status_code < 500, f"{path} {body_text(body)[:300]!r} -> {r.text[:500]}"
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["param"], f"{path} {body_text(body)[:300]!r} -> {error}"
        elif "choices" in r.text:
            assert all(c["finish_reason"] != "error" for c in r.json()["choices"]), r.text

    run()
    print(f"edge fuzz: {counts}")  # the counts SECURITY.md reports
    assert counts["5xx"] == 0 and counts["cases"] >= EDGE_EXAMPLES // 2
    assert "kvstack:internal_errors_total{" not in fuzzed.http.get("/metrics").text or all(
        line.endswith(" 0.0") for line in fuzzed.http.get("/metrics").text.splitlines()
        if line.startswith("kvstack:internal_errors_total{")
    )  # fmt: skip
