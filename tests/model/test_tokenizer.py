"""Tokenizer (vs transformers on the same GGUF), chat template, streaming detokenizer, stops."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvstack.core.errors import InvalidRequestError
from kvstack.model.loader.registry import default_model_path, load_tokenizer
from kvstack.model.tokenizer.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    find_stop,
    stop_holdback,
)
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and   multiple   spaces\t\ttabs\n\nnewlines  ",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "12345 67890 3.14159 1e-9 -42 1,000,000 2024-06-01",
    "naïve café résumé façade",
    "日本語のテキスト、中文字符。한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<|im_start|>",
    "Ω≈ç√∫˜µ≤≥÷ ∀x∈ℝ: x²≥0",
    "",
    " ",
    "\n",
    "   ",
    "I'm sure they'll say we've done what you'd've",
    "URL https://example.com/a?b=c&d=e#frag and mail a.b@c.de",
    "αβγ δεζ Привет, мир! مرحبا שלום",
    "<|im_start|><|im_end|>",
    "tabs\tand\r\nCRLF\r\n",
    "<not_special> <|im_star <|im_end",
    "x" * 200,
    "🙂" * 7,
    "\u200b zero width \ufeff BOM \u00a0nbsp",
    "Mixed123abc456DEF",
    "  indent\n    more indent\n\t\ttab indent\n",
    '{"json": [1, 2.5, null, true], "k": "v"}',
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Arr! 🏴‍☠️"},
        {"role": "user", "content": "日本語で答えて\n  with spaces  "},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def ref() -> Any:
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ------------------------------------------------------------------ ids vs transformers


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tok: Tokenizer, ref: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.eos_token_ids == frozenset({2})  # <|im_end|> is eos; <|endoftext|> not in template
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.is_special(0) and tok.is_special(2) and not tok.is_special(tok.encode("hi")[0])
    assert tok.id_to_piece(tok.encode(" world")[0]) == "Ġworld"
    with pytest.raises(InvalidRequestError):
        tok.id_to_piece(10**6)


def test_extra_eos_from_template(tok: Tokenizer) -> None:
    other = Tokenizer(
        tok.backend,
        bos_token_id=None,
        eos_token_id=0,
        chat_template="{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}",
    )
    assert other.eos_token_ids == frozenset({0, 2})


# ------------------------------------------------------------------ chat template


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, ref: Any, conv: list[dict[str, Any]], gen: bool
) -> None:
    ours = tok.apply_chat_template(conv, add_generation_prompt=gen)
    assert ours == ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
    ids = tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
    expected = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ids == list(expected)


def test_chat_template_helpers_and_kwargs(tok: Tokenizer) -> None:
    template = (
        "{{ bos_token }}{{ strftime_now('%Y') | length }}{{ extra }}{{ {'a': 'é'} | tojson }}"
    )
    out = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], chat_template=template, extra="!"
    )
    assert out == '<|im_start|>4!{"a": "é"}'


@pytest.mark.parametrize(
    "messages",
    [
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "x"}}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user", "content": None}],
        ["just a string"],
        [],
        "not a list",
    ],
)
def test_malformed_messages(tok: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(messages)


def test_text_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == (
        tok.apply_chat_template([{"role": "user", "content": "a\nb"}])
    )


def test_template_errors_and_sandbox(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tok.apply_chat_template(msgs, chat_template="{{ raise_exception('roles must alternate') }}")
    for unsafe in ("{{ messages.__class__.__mro__ }}", "{% set _ = messages.append(1) %}"):
        with pytest.raises(InvalidRequestError, match="unsafe"):
            tok.apply_chat_template(msgs, chat_template=unsafe)


# ------------------------------------------------------------------ HF folder tokenizer


def test_hf_folder_tokenizer_matches_gguf_and_transformers(tok: Tokenizer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    cfg = tiny_llama_config(vocab_size=49152, hidden_size=32, intermediate_size=32, head_dim=8)
    folder = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg), default_model_path())
    ours = load_tokenizer(str(folder))
    theirs = AutoTokenizer.from_pretrained(str(folder))
    assert ours.eos_token_ids == tok.eos_token_ids and ours.chat_template == tok.chat_template
    for text in TEXTS:
        assert ours.encode(text) == tok.encode(text) == theirs.encode(text), text
    conv = CONVERSATIONS[2]
    assert ours.apply_chat_template(conv) == theirs.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=False
    )


def test_minimal_tokenizer_roundtrip(tmp_path: Path) -> None:
    cfg = tiny_llama_config()
    folder = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg))
    t = load_tokenizer(str(folder))
    text = "the answer: 日本 😀"
    assert t.vocab_size == cfg.vocab_size and t.decode(t.encode(text)) == text
    prompt = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(prompt, str) and prompt.endswith("assistant\n")


# ------------------------------------------------------------------ streaming detokenizer


def stream(
    tok: Tokenizer, ids: list[int], chunk: int = 1, **kwargs: Any
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_never_emits_partial_characters(tok: Tokenizer, skip: bool, chunk: int) -> None:
    text = "日本語のテキスト 😀🎉👍🏽 👨‍👩‍👧 中文<|im_end|> done ✓"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some characters span tokens
    deltas, detok = stream(tok, ids, chunk, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.token_ids == ids


def test_detokenizer_random_ids_concatenate_to_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(tok.vocab_size) for _ in range(60)]
        deltas, _ = stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)


def test_detokenizer_with_prompt_context(tok: Tokenizer) -> None:
    prompt, out = tok.encode("Say: "), tok.encode("hello 😀 world")
    deltas, _ = stream(tok, out, prompt_ids=prompt)
    assert "".join(deltas) == tok.decode(out)
    emoji = tok.encode("😀")
    assert len(emoji) > 1  # a prompt cut inside a character gives no context
    deltas, _ = stream(tok, out, prompt_ids=emoji[:-1])
    assert "".join(deltas) == tok.decode(out)


def test_stop_helpers() -> None:
    assert find_stop("abc STOP x END", ["END", "STOP"]) == (4, "STOP")
    assert check_stop_strings("abc STOP x", ["STOP"]) == ("abc ", "STOP")
    assert check_stop_strings("abc STOP x", ["STOP"], include_stop_str_in_output=True) == (
        "abc STOP",
        "STOP",
    )
    assert check_stop_strings("abc", ["STOP"]) == ("abc", None)
    assert stop_holdback("hello ST", ["STOP"]) == 2
    assert stop_holdback("hello S", ["STOP", "SX"]) == 1
    assert stop_holdback("hello", ["STOP"]) == 0
    assert stop_holdback("a STOP ST", ["STOP"]) == 2
    assert stop_holdback("aaa", ["aab", "b"]) == 2


@pytest.mark.parametrize("include", [False, True])
def test_stream_stops_and_holds_back(tok: Tokenizer, include: bool) -> None:
    ids = tok.encode("Hello world. The answer is 42.\nUser: next question")
    deltas, detok = stream(tok, ids, stop=["\nUser:", "never"], include_stop_str_in_output=include)
    streamed = "".join(deltas)
    expected = "Hello world. The answer is 42." + ("\nUser:" if include else "")
    assert streamed == detok.text == expected and detok.stop_reason == "\nUser:"
    if not include:  # no delta ever showed the start of the stop string
        assert all("\n" not in d for d in deltas)
    assert detok.add_tokens(ids[:2]) == "" and detok.finish() == ""


def test_holdback_is_released_when_no_stop_follows(tok: Tokenizer) -> None:
    ids = tok.encode("wait for STO and then STOMP on it")
    deltas, detok = stream(tok, ids, stop=["STOP"])
    assert "".join(deltas) == tok.decode(ids) and detok.stop_reason is None
    # while "STO" is pending it is held back
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    streamed = "".join(detok.add_tokens(i) for i in tok.encode("wait for STO"))
    assert streamed == "wait for " and detok.finish() == "STO"


def test_gguf_add_bos_and_eos_flags() -> None:
    from kvstack.testing.tiny_models import minimal_tokenizer_metadata

    md = minimal_tokenizer_metadata(300)
    md.update({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True})
    t = Tokenizer.from_gguf_metadata(md)
    body = t.encode("the", add_special_tokens=False)
    assert t.encode("the") == [1, *body, 2] and t.decode(t.encode("the")) == "the"
