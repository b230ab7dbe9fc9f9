"""Bad and unknown input to the real server (a `kvstack serve` process on a free loopback
port): OpenAI-shaped errors, unknown fields ignored and reported, and a fuzz that never
breaks the server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyed_server_util import KEY, keyed_server, wait_idle
from server_util import ServerProcess


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with keyed_server(tmp_path_factory.mktemp("server")) as s:
        yield s
        wait_idle(s)  # the pool is clean after the bad input and the fuzz


BAD: list[tuple[str, Any, int, str]] = [
    ("/v1/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/completions", b"\xff\xfe{}", 400, "UTF-8"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "bogus_field": 1, "max_tokens": "x"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "token ids"),
    ("/v1/completions", {"prompt": "x" * 70000}, 413, "body"),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, 400, "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/nope", {}, 404, "Not Found"),
    ("/v1/completions", {"prompt": "hi", "kv_press": "zip"}, 400, "unknown kv_press"),
    ("/v1/completions", {"prompt": "hi", "kv_press": "snapkv", "kv_press_ratio": 1}, 400, "[0, 1)"),
    ("/v1/completions", {"prompt": "hi", "kv_press_ratio": 0.5}, 400, "needs a kv_press"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD)
def test_bad_input_gets_openai_errors(
    srv: ServerProcess, path: str, body: Any, status: int, needle: str
) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + path, content=data, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower() and {"type", "param", "code"} <= set(err)


def test_unknown_fields_are_ignored_and_reported(srv: ServerProcess) -> None:
    """As vLLM: an unknown field is accepted, ignored, logged and named in a header."""
    body = {
        "messages": [{"role": "user", "content": "Hi", "foo": 1}],
        "max_tokens": 2,
        "bogus_field": True,
        "stream": True,  # vLLM: stream_options only with stream
        "stream_options": {"include_usage": True, "bar": 0},
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    got = set(r.headers["kvstack-ignored-fields"].split(","))
    assert got == {"bogus_field", "messages.0.foo", "stream_options.bar"}
    assert "ignoring unknown fields" in srv.tail() and "bogus_field" in srv.tail()
    plain = httpx.post(srv.url + "/tokenize", json={"prompt": "Hi"}, headers=headers)
    assert plain.status_code == 200 and "kvstack-ignored-fields" not in plain.headers


FLOATS = st.floats(allow_nan=False, allow_infinity=False)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | FLOATS | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=10,
)
FIELDS = [
    "prompt",
    "messages",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "echo",
    "stream",
    "top_k",
    "min_p",
    "presence_penalty",
    "repetition_penalty",
    "stop_token_ids",
    "logit_bias",
    "model",
    "user",
    "extra",
    "chat_template_kwargs",
    "stream_options",
    "max_completion_tokens",
    "min_tokens",
]
BODY = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).map(
    lambda d: {**d, "max_tokens": 4}
) | st.fixed_dictionaries(
    {
        "prompt": st.text(min_size=1, max_size=40),
        "max_tokens": st.integers(-2, 6),
        "n": st.integers(0, 3),
        "temperature": st.floats(-1, 3),
        "stop": st.lists(st.text(max_size=3)),
    },
)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, chat=st.booleans())
def test_fuzz_never_breaks_the_server(srv: ServerProcess, body: dict, chat: bool) -> None:
    if chat and "prompt" in body:
        body = {**body, "messages": [{"role": "user", "content": body.pop("prompt")}]}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(srv.url + path, json=body, headers=auth, timeout=60)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(srv.url + "/health").status_code == 200
