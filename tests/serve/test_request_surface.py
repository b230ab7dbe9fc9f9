"""Leniency and the rest of the OpenAI request surface on a tiny random model, in process.

Leniency (unknown fields ignored, logged and named in ``kvstack-ignored-fields``), the
documented request bodies in ``/openapi.json``, ``developer`` messages and content parts
rendered the same on every path, ``continue_final_message``, ``continuous_usage_stats``,
``bad_words``, ``allowed_token_ids``, ``truncate_prompt_tokens``, ``--generation-config``
and ``--chat-template``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvstack import LLM, SamplingParams
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.testing.tiny_models import (
    random_llama_weights,
    tiny_llama_config,
    write_gguf,
    write_hf_folder,
)

# temperature and top_p apply; top_k 50 and repetition_penalty 1.0 are transformers'
# defaults, which vLLM does not count as choices; max_new_tokens is max_tokens.
GEN_CONFIG = {
    "temperature": 0.0, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0,
    "max_new_tokens": 5, "bos_token_id": 1,
}  # fmt: skip
GEN_DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
SYSTEM = "You answer questions about the museum: hours, tickets and tours, briefly."
OPTS: dict[str, Any] = {"dtype": "float32", "num_blocks": 64, "max_model_len": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    d = write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))
    (d / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return d


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **OPTS)


class Served:
    """The app over a tiny engine, recording what each request queued."""

    def __init__(self, model_dir: Path) -> None:
        self.llm = LLM(str(model_dir), **OPTS)
        self.engine = AsyncEngine(self.llm.engine)
        self.added: list[tuple[str, list[int], SamplingParams]] = []
        real = self.engine.add

        async def spy(rid: str, ids: list[int], sp: SamplingParams, *a: Any, **kw: Any) -> Any:
            self.added.append((rid, list(ids), sp))
            return await real(rid, ids, sp, *a, **kw)

        self.engine.add = spy  # type: ignore[method-assign]
        self.app = create_app(self.engine, ServerConfig(model_name="tiny"))

    def last(self) -> tuple[list[int], SamplingParams]:
        _, ids, sp = self.added[-1]
        return ids, sp


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[Served, TestClient]]:
    s = Served(model_dir)
    with TestClient(s.app) as client:
        yield s, client


def err(r: Any, param: str) -> str:
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and e["type"] == "BadRequestError", e
    return str(e["message"])


def ids_for(client: TestClient, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    r = client.post("/tokenize", json={"messages": messages, **kw})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


# ------------------------------------------------------------------------ leniency


def test_unknown_fields_are_ignored_logged_and_named(
    served: tuple[Served, TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    _, c = served
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "x": 1}]}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "bar": 0},
        "metadata": {"k": "v"},
        "a,b\nc": 1,
    }
    with caplog.at_level(logging.WARNING, logger="kvstack.serve"):
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    got = r.headers["kvstack-ignored-fields"].split(",")
    assert set(got) == {"metadata", "a%2Cb%0Ac", "stream_options.bar",
                        "messages.0.content.0.x"}  # fmt: skip
    assert "ignoring unknown fields" in caplog.text and "metadata" in caplog.text
    plain = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert plain.status_code == 200 and "kvstack-ignored-fields" not in plain.headers
    # /tokenize honours return_token_strs (vLLM's); /detokenize has no such field.
    r = c.post("/detokenize", json={"tokens": [5], "return_token_strs": True})
    assert r.status_code == 200 and r.headers["kvstack-ignored-fields"] == "return_token_strs"
    # Still strictly typed: a known field of the wrong type is a 400 naming it.
    bad = {"prompt": "hi", "stream_options": {"include_usage": "yes"}, "zzz": 1}
    err(c.post("/v1/completions", json=bad), "stream_options.include_usage")
    err(c.post("/v1/completions", json={"prompt": "hi", "bad_words": "x"}), "bad_words")
    # The bounded reader still answers 413 and 400 before anything is validated.
    assert c.post("/v1/completions", content=b"\xff{}").status_code == 400
    big = b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    assert c.post("/v1/completions", content=big).status_code == 413


def test_openapi_documents_every_request_body(served: tuple[Served, TestClient]) -> None:
    _, c = served
    doc = c.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model, field in [
        ("/v1/completions", "CompletionRequest", "prompt"),
        ("/v1/chat/completions", "ChatCompletionRequest", "messages"),
        ("/tokenize", "TokenizeRequest", "messages"),
        ("/detokenize", "DetokenizeRequest", "tokens"),
        ("/v1/cache/pin", "PinRequest", "messages"),
        ("/v1/cache/unpin", "PinRequest", "prompt"),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and body["required"], path
        assert field in schemas[model]["properties"], (model, field)
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"bad_words", "allowed_token_ids", "truncate_prompt_tokens"} <= set(chat)
    assert "continuous_usage_stats" in schemas["StreamOptions"]["properties"]
    for name in re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(doc)):
        assert name in schemas, name  # every reference resolves


# ------------------------------------------------------------ messages on every path


def test_developer_is_system_on_chat_tokenize_and_pin(served: tuple[Served, TestClient]) -> None:
    s, c = served
    dev = [{"role": "developer", "content": SYSTEM}]
    sys_ = [{"role": "system", "content": SYSTEM}]
    assert ids_for(c, dev, add_generation_prompt=False) == ids_for(
        c, sys_, add_generation_prompt=False
    )
    r = c.post("/v1/cache/pin", json={"messages": dev})
    assert r.status_code == 200 and r.json()["pinned_tokens"] >= 16, r.text
    pin_ids = next(ids for rid, ids, _ in reversed(s.added) if rid.startswith("pin-"))
    chat = c.post(
        "/v1/chat/completions",
        json={"messages": dev, "add_generation_prompt": False, "max_tokens": 1},
    )
    assert chat.status_code == 200, chat.text
    assert s.last()[0] == pin_ids  # the pinned prefix is what chat computes
    question = {"messages": [*dev, {"role": "user", "content": "Tours?"}], "max_tokens": 1}
    ask = c.post("/v1/chat/completions", json=question)
    assert s.last()[0][: len(pin_ids)] == pin_ids
    cached = ask.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= r.json()["pinned_tokens"]
    assert c.post("/v1/cache/unpin", json={"messages": dev}).json() == {"unpinned": True}


def test_content_parts_join_like_llm_chat(served: tuple[Served, TestClient], offline: LLM) -> None:
    s, c = served
    parts = [{"type": "text", "text": "first line"}, {"type": "text", "text": "second"}]
    msgs: list[dict[str, Any]] = [{"role": "developer", "content": parts}]
    msgs.append({"role": "user", "content": "and a question"})
    server_ids = ids_for(c, msgs)
    out = offline.chat(msgs, SamplingParams(max_tokens=1))[0]
    assert out.prompt_token_ids == server_ids
    joined = [{"role": "system", "content": "first line\nsecond"}, msgs[1]]
    assert ids_for(c, joined) == server_ids
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.status_code == 200 and s.last()[0] == server_ids


def test_add_generation_prompt_and_continue_final_message(
    served: tuple[Served, TestClient], offline: LLM
) -> None:
    s, c = served
    tok = s.llm.tokenizer
    user = {"role": "user", "content": "Name a colour."}
    partial = {"role": "assistant", "content": "The colour is"}
    with_prompt = tok.decode(ids_for(c, [user]), skip_special_tokens=False)
    without = tok.decode(ids_for(c, [user], add_generation_prompt=False), skip_special_tokens=False)
    assert with_prompt == without + "<|im_start|>assistant\n"
    cont = ids_for(c, [user, partial], add_generation_prompt=False, continue_final_message=True)
    text = tok.decode(cont, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nThe colour is"), text
    body = {"messages": [user, partial], "max_tokens": 1, "add_generation_prompt": False,
            "continue_final_message": True}  # fmt: skip
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert s.last()[0] == cont
    out = offline.chat([user, partial], SamplingParams(max_tokens=1),
                       add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    assert out[0].prompt_token_ids == cont
    # vLLM's rules: not with add_generation_prompt, and only an assistant message.
    both = {**body, "add_generation_prompt": True}
    assert "add_generation_prompt" in err(c.post("/v1/chat/completions", json=both),
                                          "continue_final_message")  # fmt: skip
    last_user = {**body, "messages": [user]}
    assert "assistant" in err(c.post("/v1/chat/completions", json=last_user),
                              "continue_final_message")  # fmt: skip
    tokenize = {"messages": [user], "add_generation_prompt": False, "continue_final_message": True}
    err(c.post("/tokenize", json=tokenize), "continue_final_message")
    with pytest.raises(InvalidRequestError, match="add_generation_prompt"):
        offline.chat([user, partial], continue_final_message=True)


# ------------------------------------------------------------------ streaming usage


def test_continuous_usage_stats_puts_usage_in_every_chunk(
    served: tuple[Served, TestClient],
) -> None:
    _, c = served
    base = {"prompt": "Count:", "max_tokens": 4, "ignore_eos": True, "stream": True}

    def chunks(opts: dict[str, Any]) -> list[dict[str, Any]]:
        r = c.post("/v1/completions", json={**base, "stream_options": opts})
        assert r.status_code == 200, r.text
        lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(ln) for ln in lines[:-1]]

    got = chunks({"include_usage": True, "continuous_usage_stats": True})
    with_choices = [ch for ch in got if ch["choices"]]
    assert with_choices and all("usage" in ch for ch in with_choices)
    done = [ch["usage"]["completion_tokens"] for ch in with_choices]
    assert done == sorted(done) and done[-1] == 4
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 4
    assert all(ch["usage"]["prompt_tokens"] == got[-1]["usage"]["prompt_tokens"] for ch in got)
    plain = chunks({"include_usage": True})
    assert not any("usage" in ch for ch in plain if ch["choices"])
    # vLLM: continuous usage needs include_usage.
    assert not any("usage" in ch for ch in chunks({"continuous_usage_stats": True}))


# --------------------------------------------------- bad_words, allowed_token_ids, truncation


def letters(llm: LLM, word: str) -> list[int]:
    return [llm.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in word]


def test_allowed_token_ids_and_bad_words_offline(offline: LLM) -> None:
    ab = letters(offline, "ab")
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=ab)
    free = offline.generate(["Letters:"], sp)[0].outputs[0]
    assert set(free.token_ids) <= set(ab)
    # Banning "ab" and "ba" leaves one letter repeated.
    sp.bad_words = ["ab", "ba"]
    out = offline.generate(["Letters:"], sp)[0].outputs[0]
    assert out.text in ("a" * 8, "b" * 8), out.text
    # A one-token bad word is banned everywhere, also at temperature 1 with a seed.
    rnd = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                         allowed_token_ids=letters(offline, "abc"), bad_words=["c"])  # fmt: skip
    got = offline.generate(["Letters:", "More:"], rnd)
    assert all("c" not in o.outputs[0].text and o.outputs[0].text for o in got)
    for bad, param in [
        (SamplingParams(allowed_token_ids=[10**6]), "allowed_token_ids"),
        (SamplingParams(bad_words=[" "]), "bad_words"),
        (SamplingParams(truncate_prompt_tokens=1000), "truncate_prompt_tokens"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            offline.generate(["hi"], bad)
        assert e.value.param == param
    assert not offline.engine.has_unfinished_requests()


def test_truncate_prompt_tokens(served: tuple[Served, TestClient], offline: LLM) -> None:
    s, c = served
    prompt = list(range(40, 80))
    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 8, "echo": True}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert s.last()[0] == prompt[-8:] and r.json()["usage"]["prompt_tokens"] == 8
    echoed = r.json()["choices"][0]["text"]
    assert echoed.startswith(s.llm.tokenizer.decode(prompt[-8:]))
    chat = {"messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 1,
            "truncate_prompt_tokens": 5}  # fmt: skip
    assert c.post("/v1/chat/completions", json=chat).status_code == 200
    assert len(s.last()[0]) == 5
    for k in (0, -2, 257):
        body = {"prompt": "hi", "truncate_prompt_tokens": k}
        err(c.post("/v1/completions", json=body), "truncate_prompt_tokens")
    err(c.post("/v1/completions", json={"prompt": "hi", "truncate_prompt_tokens": "3"}),
        "truncate_prompt_tokens")  # fmt: skip
    out = offline.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(truncate_prompt_tokens=-1)
    )
    assert out[0].prompt_token_ids == prompt  # -1: max_model_len (256) keeps all 40
    out = offline.generate(["abcdefgh"], SamplingParams(max_tokens=1, truncate_prompt_tokens=3))
    assert len(out[0].prompt_token_ids) == 3


def test_server_rejects_bad_vocab_constraints_with_their_param(
    served: tuple[Served, TestClient],
) -> None:
    s, c = served
    vocab = s.engine.model_info.vocab_size
    for body, param in [
        ({"allowed_token_ids": [vocab]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": ["5"]}, "allowed_token_ids.0"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": ["x"] * 200}, "bad_words"),
    ]:
        err(c.post("/v1/completions", json={"prompt": "hi", **body}), param)
    ok = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
          "allowed_token_ids": letters(s.llm, "xy"), "bad_words": ["x"]}  # fmt: skip
    r = c.post("/v1/completions", json=ok)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "yyy", r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], **ok}
    chat.pop("prompt")
    assert (
        c.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        == "yyy"
    )


# ------------------------------------------------------ generation config, chat template


def test_generation_config_defaults_apply_to_unset_fields(
    served: tuple[Served, TestClient], offline: LLM, model_dir: Path, tmp_path: Path
) -> None:
    s, c = served
    assert s.engine.generation_defaults == GEN_DEFAULTS
    # Completions' max_tokens defaults to 16 as in vLLM (its field default wins over the
    # model's max_new_tokens); null leaves it to the engine: the generation config's 5.
    r = c.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    _, sp = s.last()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.0, 0.9, 0, 16)
    r = c.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    _, sp = s.last()  # max_tokens null: the engine takes the default (capped by the context)
    assert sp.max_tokens is None
    explicit = {"prompt": "hi", "temperature": 0.7, "top_p": 1.0, "top_k": 3, "max_tokens": 2}
    assert c.post("/v1/completions", json=explicit).status_code == 200
    _, sp = s.last()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (0.7, 1.0, 3, 2)
    # Offline: generate without SamplingParams uses them; max_tokens=None is capped by them.
    assert offline.get_default_sampling_params() == SamplingParams(**GEN_DEFAULTS)
    out = offline.generate(["hi"], SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    # vllm: none; a folder: its file; a GGUF under auto: none.
    assert LLM(str(model_dir), generation_config="vllm", **OPTS).engine.generation_defaults == {}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 7, "min_p": 0.05}))
    eng = LLM(str(model_dir), generation_config=str(other), **OPTS).engine
    assert eng.generation_defaults == {"top_k": 7, "min_p": 0.05}
    cfg = tiny_llama_config()
    gguf = write_gguf(tmp_path / "tiny.gguf", cfg, random_llama_weights(cfg))
    assert LLM(str(gguf), **OPTS).engine.generation_defaults == {}
    with pytest.raises(ConfigError, match=r"no generation_config\.json"):
        LLM(str(model_dir), generation_config=str(tmp_path / "nowhere"), **OPTS)
    (other / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigError, match="temperature"):
        LLM(str(model_dir), generation_config=str(other), **OPTS)


def test_chat_template_option_replaces_the_models(model_dir: Path, tmp_path: Path) -> None:
    inline = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\\n{% endfor %}"
    llm = LLM(str(model_dir), chat_template=inline, **OPTS)
    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert llm.tokenizer.apply_chat_template(msgs) == "[system]be brief\n[user]hi\n"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    llm = LLM(str(model_dir), chat_template=str(path), **OPTS)
    tok = llm.tokenizer
    assert tok.apply_chat_template(msgs) == "<|im_start|>be brief<|im_end|><|im_start|>hi<|im_end|>"
    assert tok.backend.token_to_id("<|im_end|>") in tok.eos_token_ids
    out = llm.chat(msgs, SamplingParams(max_tokens=1), chat_template=inline)
    assert tok.decode(out[0].prompt_token_ids) == "[system]be brief\n[user]hi\n"
    with pytest.raises(ConfigError, match="looks like a path"):
        LLM(str(model_dir), chat_template=str(tmp_path / "missing.jinja"), **OPTS)
    with pytest.raises(ConfigError, match="does not compile"):
        LLM(str(model_dir), chat_template="{% for %}", **OPTS)


def test_sampling_params_defaults_stay_vllms() -> None:
    sp = SamplingParams()
    assert (sp.bad_words, sp.allowed_token_ids, sp.truncate_prompt_tokens) == ([], None, None)
    assert SamplingParams(bad_words="x").bad_words == ["x"]  # type: ignore[arg-type]
