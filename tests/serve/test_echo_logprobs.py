"""``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` over HTTP, on a tiny random
model (fp32) with the default model's tokenizer: the server's prompt logprobs are the
offline engine's, in OpenAI's and vLLM's shapes (what lm-evaluation-harness reads)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstack import LLM, SamplingParams
from kvstack.core.request import RequestOutput
from kvstack.model.loader.registry import default_model_path
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

PROMPTS = ["The sky over the harbour is", "Question: 2 + 2 = ? Answer: 4"]
OPTS: dict[str, Any] = dict(dtype="float32", num_blocks=96, block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config(vocab_size=49152)
    path = tmp_path_factory.mktemp("echo") / "tiny.gguf"
    return write_gguf(
        path, cfg, random_llama_weights(cfg, seed=5), tokenizer_from=default_model_path()
    )


@pytest.fixture(scope="module")
def offline(model_path: Path) -> LLM:
    return LLM(str(model_path), **OPTS)


@pytest.fixture(scope="module")
def client(model_path: Path) -> Iterator[TestClient]:
    engine = AsyncEngine(LLM(str(model_path), **OPTS).engine)
    with TestClient(create_app(engine, ServerConfig(model_name="tiny"))) as c:
        yield c


def reference(llm: LLM, prompt: str | list[int], k: int, max_tokens: int = 1) -> RequestOutput:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k)
    if isinstance(prompt, str):
        return llm.generate([prompt], sp)[0]
    return llm.generate(sampling_params=sp, prompt_token_ids=[prompt])[0]


def post(c: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def sse(c: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = c.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def check_against(
    choice: dict[str, Any], want: RequestOutput, k: int, echo_only: bool = False
) -> None:
    """An echoed choice's logprobs are the offline prompt logprobs, then the generated token's."""
    plp, out = want.prompt_logprobs, want.outputs[0]
    assert plp is not None and out.logprobs is not None
    ids = list(want.prompt_token_ids) + ([] if echo_only else list(out.token_ids))
    wants = list(plp) + ([] if echo_only else list(out.logprobs))
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i, (tid, d) in enumerate(zip(ids, wants, strict=True)):
        if d is None:
            continue
        assert lp["token_logprobs"][i] == pytest.approx(d[tid].logprob, abs=1e-4)
        top = lp["top_logprobs"][i]
        assert 1 <= len(top) <= k + 1
        assert max(top.values()) == pytest.approx(max(x.logprob for x in d.values()), abs=1e-4)
    offsets, pos = [], 0
    for t in lp["tokens"]:
        offsets.append(pos)
        pos += len(t)
    assert lp["text_offset"] == offsets
    assert choice["text"] == want.prompt + ("" if echo_only else out.text)  # type: ignore[operator]


def test_echo_logprobs_are_the_offline_prompt_logprobs(client: TestClient, offline: LLM) -> None:
    # lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 1.
    for prompt in PROMPTS:
        body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        got = post(client, "/v1/completions", body)
        check_against(got["choices"][0], reference(offline, prompt, 1), k=1)
    # A batch of token-id prompts (how lm-eval sends them), logprobs 2.
    tok = offline.tokenizer
    batch = [tok.encode(p) for p in PROMPTS]
    got = post(
        client,
        "/v1/completions",
        {"prompt": batch, "echo": True, "logprobs": 2, "max_tokens": 2, "temperature": 0},
    )
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for ids, choice in zip(batch, got["choices"], strict=True):
        want = reference(offline, ids, 2, max_tokens=2)
        want.prompt = tok.decode(ids, skip_special_tokens=False)
        check_against(choice, want, k=2)
    assert got["usage"]["prompt_tokens"] == sum(len(b) for b in batch)


def test_prompt_logprobs_field_is_vllms_format(client: TestClient, offline: LLM) -> None:
    prompt = PROMPTS[0]
    want = reference(offline, prompt, 3)
    assert want.prompt_logprobs is not None
    got = post(
        client,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3},
    )
    choice = got["choices"][0]
    assert choice["logprobs"] is None and choice["text"] == want.outputs[0].text
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(want.prompt_token_ids) and plp[0] is None
    tok = offline.tokenizer
    for tid, entry, ref in zip(
        want.prompt_token_ids[1:], plp[1:], want.prompt_logprobs[1:], strict=True
    ):
        assert ref is not None and str(tid) in entry and len(entry) <= 4
        assert set(entry) == {str(t) for t in ref}
        for t, v in entry.items():
            assert set(v) == {"logprob", "rank", "decoded_token"}
            assert v["logprob"] == pytest.approx(ref[int(t)].logprob, abs=1e-4)
            assert v["rank"] == ref[int(t)].rank
            assert v["decoded_token"] == tok.decode([int(t)], skip_special_tokens=False)
    # Without echo or prompt_logprobs the field is there, null (as in vLLM).
    plain = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert plain["choices"][0]["prompt_logprobs"] is None
    # Chat: at the top level of the answer.
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = post(
        client, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "prompt_logprobs": 1}
    )
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 for e in chat["prompt_logprobs"][1:])


def test_echo_with_max_tokens_0_n_and_streaming(client: TestClient, offline: LLM) -> None:
    prompt = PROMPTS[1]
    body: dict[str, Any] = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
    got = post(client, "/v1/completions", body)
    check_against(got["choices"][0], reference(offline, prompt, 1), k=1, echo_only=True)
    streamed = sse(client, "/v1/completions", body)
    assert "".join(ch["text"] for s in streamed for ch in s["choices"]) == prompt
    assert streamed[-1]["choices"][0]["finish_reason"] is not None
    # n > 1: every choice starts with the prompt and its logprobs.
    many = post(
        client,
        "/v1/completions",
        {**body, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True},
    )
    assert len(many["choices"]) == 2
    n_prompt = len(offline.tokenizer.encode(prompt))
    for ch in many["choices"]:
        assert ch["text"].startswith(prompt)
        assert ch["logprobs"]["token_logprobs"][0] is None
        assert len(ch["logprobs"]["tokens"]) == n_prompt + 3
    # Streaming: the prompt (text and logprobs) in each choice's first chunk; the chunks
    # add up to the non-streamed answer, offsets included.
    body = {
        "prompt": PROMPTS,
        "echo": True,
        "logprobs": 1,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    full = post(client, "/v1/completions", body)
    chunks = sse(client, "/v1/completions", body)
    for choice in full["choices"]:
        mine = [ch for s in chunks for ch in s["choices"] if ch["index"] == choice["index"]]
        assert mine[0]["text"].startswith(PROMPTS[choice["index"]])
        assert mine[0]["logprobs"]["token_logprobs"][0] is None
        assert "".join(ch["text"] for ch in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            joined = [x for ch in mine if ch["logprobs"] for x in ch["logprobs"][key]]
            assert joined == pytest.approx(choice["logprobs"][key], abs=1e-4)


def test_chat_echo_and_continue_final_message(client: TestClient, offline: LLM) -> None:
    partial = "The capital of France is"
    msgs = [
        {"role": "user", "content": "Name a capital."},
        {"role": "assistant", "content": partial},
    ]
    body: dict[str, Any] = {
        "messages": msgs,
        "echo": True,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 3,
        "temperature": 0,
    }
    got = post(client, "/v1/chat/completions", body)
    msg = got["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].startswith(partial)
    # The prompt ends inside the assistant message: the offline engine given the same
    # cut-off rendering generates the same continuation.
    tok = offline.tokenizer
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert isinstance(text, str)
    cut = text[: text.rindex(partial) + len(partial)]
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)
    want = offline.generate([cut], sp)[0]
    assert msg["content"] == partial + want.outputs[0].text
    assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    # echo asks for prompt logprobs (top_logprobs, default 0), as vLLM does.
    assert want.prompt_logprobs is not None
    ids = want.prompt_token_ids
    got_lps = [e and e[str(t)]["logprob"] for t, e in zip(ids, got["prompt_logprobs"], strict=True)]
    want_lps = [e and e[t].logprob for t, e in zip(ids, want.prompt_logprobs, strict=True)]
    assert got_lps == pytest.approx(want_lps, abs=1e-4)
    # Streaming: the echo opens the first delta; the deltas add up to the message.
    chunks = sse(client, "/v1/chat/completions", body)
    deltas = [ch["delta"] for s in chunks for ch in s["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"].startswith(partial)
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    # The last message is not the answer's role: nothing is echoed.
    user_last = post(
        client, "/v1/chat/completions", {"messages": msgs[:1], "echo": True, "max_tokens": 2}
    )
    assert not user_last["choices"][0]["message"]["content"].startswith("Name a capital")
    # add_generation_prompt false without continuing: the answer takes the last role.
    same_role = post(client, "/v1/chat/completions", {**body, "continue_final_message": False})
    assert same_role["choices"][0]["message"]["content"].startswith(partial)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (
        "/v1/completions",
        {"prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 1},
        "min_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 99},
        "prompt_logprobs",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": 1}, "echo"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
        "continue_final_message",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_echo_and_prompt_logprobs_input(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200
