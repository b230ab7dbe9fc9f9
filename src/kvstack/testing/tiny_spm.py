"""Tiny SentencePiece BPE vocabularies written as vocabulary-only GGUF files, for tests.

``train_spm_bpe`` trains a real SentencePiece BPE model (the ``sentencepiece`` package, a
test dependency) on text generated here, so nothing is downloaded. ``spm_gguf_metadata``
turns the trained model into the ``tokenizer.*`` keys llama.cpp's converter writes for a
SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``: tokens, scores, token types
in SentencePiece's numbering, which llama.cpp kept: 1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte), and ``write_tokenizer_gguf`` writes them with
``gguf.GGUFWriter`` next to a few ``{arch}.*`` keys and one small tensor, enough for
transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` to read the file.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_WORD_TEXT = (
    "the quick brown fox jumps over lazy dog model token cache block prefix server "
    "request stream attention layer weight quantized memory paged radix tree hello world "
    "never ever again every evening seven eleven twelve number letter bigger smaller "
    "international interesting interest internet intern internal tokenization token tokens"
)
_WORDS = tuple(_WORD_TEXT.split())
_EXTRA = (
    "Numbers 0123456789 and 3.14159, 2026-12-02; punctuation: !?.,;:'\"()[]{}<>/\\|@#$%^&*_+=-~`",
    "Tabs\tand\ttabs, new\nlines\n\nand  double  spaces   triple.",
    "CJK 你好世界 日本語 한국어 and accents café naïve Zürich.",
)


def training_text(n_lines: int = 400, seed: int = 0) -> str:
    """Deterministic English-like lines (plus digits, punctuation, tabs, CJK) to train on."""
    rng = random.Random(seed)
    lines = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14))) for _ in range(n_lines)
    ]
    lines += list(_EXTRA) * 3
    rng.shuffle(lines)
    return "\n".join(lines) + "\n"


def train_spm_bpe(
    folder: Path,
    *,
    vocab_size: int = 600,
    add_dummy_prefix: bool = True,
    user_defined: tuple[str, ...] = ("<start_of_turn>", "<end_of_turn>", "<tool>"),
    control: tuple[str, ...] = ("<ctl>",),
    byte_fallback: bool = True,
    specials: tuple[str, str, str] = ("<unk>", "<s>", "</s>"),
    name: str = "spm",
) -> Path:
    """Train a SentencePiece BPE model (byte fallback on, like Llama's) and return its path.

    ``specials`` are the unknown, BOS and EOS pieces (ids 0, 1, 2): Llama's by default,
    ``("<unk>", "<bos>", "<eos>")`` for a Gemma-like vocabulary.
    """
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / f"{name}.txt"
    corpus.write_text(training_text(), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / name),
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=byte_fallback,
        character_coverage=1.0,
        add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=list(user_defined),
        control_symbols=list(control),
        unk_id=0,
        bos_id=1,
        eos_id=2,
        unk_piece=specials[0],
        bos_piece=specials[1],
        eos_piece=specials[2],
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    return folder / f"{name}.model"


def spm_gguf_metadata(
    model_file: Path,
    *,
    add_bos: bool | None = True,
    add_eos: bool = False,
    gemma_spaces: bool = False,
) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata llama.cpp's converter writes for this SentencePiece model.

    ``add_bos=None`` leaves ``add_bos_token`` out (older files); ``gemma_spaces`` spells
    pieces of two or more "▁" with real spaces, as Gemma's GGUF files do.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb2

    proto = pb2.ModelProto()  # type: ignore[attr-defined]  # generated protobuf module
    proto.ParseFromString(model_file.read_bytes())
    pieces = list(proto.pieces)
    tokens = [p.piece for p in pieces]
    if gemma_spaces:
        tokens = [" " * len(t) if len(t) > 1 and not t.strip("\u2581") else t for t in tokens]
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [float(p.score) for p in pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in pieces],
        "tokenizer.ggml.add_space_prefix": bool(proto.normalizer_spec.add_dummy_prefix),
        "tokenizer.ggml.add_eos_token": add_eos,
    }
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = add_bos
    spec = proto.trainer_spec
    for key, tid in (("bos", spec.bos_id), ("eos", spec.eos_id), ("unknown", spec.unk_id)):
        if tid >= 0:
            md[f"tokenizer.ggml.{key}_token_id"] = tid
    md["tokenizer.ggml.padding_token_id"] = spec.eos_id if spec.pad_id < 0 else spec.pad_id
    return md


def write_tokenizer_gguf(path: Path, md: dict[str, Any], arch: str = "llama") -> Path:
    """Write ``md`` (``tokenizer.*`` keys) as a vocabulary-only GGUF of architecture ``arch``.

    Values are written with the types llama.cpp uses (token types INT32, scores FLOAT32,
    ids UINT32); a key whose value is ``None`` is left out (tests of missing fields).
    """
    n_vocab = len(md.get("tokenizer.ggml.tokens") or []) or 1
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"tiny-{arch}-spm")
    for key, value in (
        ("context_length", 64),
        ("embedding_length", 8),
        ("block_count", 1),
        ("feed_forward_length", 16),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 1),
        ("attention.key_length", 4),
        ("attention.value_length", 4),
        ("vocab_size", n_vocab),
    ):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    arrays = {
        "tokenizer.ggml.token_type": gguf.GGUFValueType.INT32,
        "tokenizer.ggml.scores": gguf.GGUFValueType.FLOAT32,
    }
    for key, value in md.items():
        if value is None:
            continue
        if key in arrays:
            w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=arrays[key])
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            raise TypeError(f"cannot write {key}={value!r}")
    w.add_tensor("token_embd.weight", np.zeros((n_vocab, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
