"""``--reasoning-parser`` through chat completions on a tiny random Qwen3 (scripted text
through ``guided_choice``): ``reasoning`` beside ``content``, streamed deltas that join to
the unstreamed message, and the start-up check of the template's markers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from reasoning_util import tiny_qwen3

from kvstack import LLM
from kvstack.core.errors import ConfigError
from kvstack.serve.api.app import ServerConfig, create_app
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.conversation_options import ConversationOptions
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

SCRIPT = "<think>\nThe user greets me.\n</think>\n\nHello!"
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    llm = tiny_qwen3(tmp_path_factory.mktemp("q3"))
    conv = ConversationOptions(reasoning_parser="qwen3")
    app = create_app(AsyncEngine(llm.engine), ServerConfig("tiny", conversation=conv))
    with TestClient(app) as c:
        yield c


def test_chat_message_has_reasoning_beside_content(client: TestClient) -> None:
    body = {"messages": ASK, "guided_choice": [SCRIPT], "max_tokens": 60}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning"] == "\nThe user greets me.\n"
    assert msg["content"] == "\n\nHello!"


def test_streamed_deltas_join_to_the_message(client: TestClient) -> None:
    body = {"messages": ASK, "guided_choice": [SCRIPT], "max_tokens": 60, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    deltas: list[dict[str, Any]] = [
        json.loads(ln)["choices"][0]["delta"] for ln in lines[:-1] if json.loads(ln)["choices"]
    ]
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("\nThe user greets me.\n", "\n\nHello!")
    assert all("<think>" not in (d.get("content") or "") for d in deltas)
    # Reasoning is streamed before the answer begins, not all at the end.
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert any(d.get("reasoning") for d in deltas[:first_content])


def test_thinking_off_is_all_content(client: TestClient) -> None:
    body = {"messages": ASK, "guided_choice": ["Just hi."], "max_tokens": 30,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (msg["reasoning"], msg["content"]) == (None, "Just hi.")


def test_parser_that_does_not_fit_the_template_fails_at_start_up(tmp_path: Path) -> None:
    cfg = tiny_llama_config()
    path = write_gguf(tmp_path / "chatml.gguf", cfg, random_llama_weights(cfg))
    engine = AsyncEngine(LLM(str(path), dtype="float32", num_blocks=16).engine)
    conv = ConversationOptions(reasoning_parser="deepseek_r1")
    with pytest.raises(ConfigError) as e:
        create_app(engine, ServerConfig("tiny", conversation=conv))
    assert "<|im_start|>, <|im_end|>" in str(e.value) and "<think>" in str(e.value)
    with pytest.raises(ConfigError, match="choose one of: deepseek_r1, qwen3"):
        ConversationOptions(reasoning_parser="granite")


def test_an_answers_reasoning_reaches_the_template(client: TestClient) -> None:
    """vLLM's ``reasoning`` (or the older ``reasoning_content``) on an assistant message is
    the template's ``reasoning_content``: Qwen3's renders it after the last user turn."""
    for field in ("reasoning", "reasoning_content"):
        msgs = [*ASK, {"role": "assistant", "content": "Hello!", field: "Be kind."}]
        body = {"messages": msgs, "add_generation_prompt": False}
        ids = client.post("/tokenize", json=body).json()["tokens"]
        text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "<think>\nBe kind.\n</think>\n\nHello!" in text
