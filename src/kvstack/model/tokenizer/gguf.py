"""A ``tokenizers`` backend from a GGUF file's ``tokenizer.*`` metadata (llama.cpp key names).

::

    tokenizer.ggml.model       "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE,
                               ``kvstack.model.tokenizer.spm``)
    tokenizer.ggml.pre         pre-tokenizer name of a byte-level BPE ("smollm", "qwen2", ...)
    tokenizer.ggml.tokens      [str]   vocabulary
    tokenizer.ggml.merges      [str]   "a b" merge rules, best first (byte-level BPE)
    tokenizer.ggml.scores      [float] piece scores (SentencePiece)
    tokenizer.ggml.token_type  [int]   1 normal, 2 unknown, 3 control, 4 user-defined,
                                       5 unused, 6 byte
    tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token

Both kinds are rebuilt the way transformers rebuilds them, so token ids match
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``. Control tokens and the BOS/EOS/
unknown/padding tokens become special added tokens (``"<|im_start|>"`` or
``"<start_of_turn>"`` in text encodes to its single id and is never split); user-defined
tokens become plain added tokens, matched whole as llama.cpp does. Every problem with the
metadata is a ``ModelLoadError`` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from kvstack.core.errors import ModelLoadError
from kvstack.model.tokenizer.spm import build_spm_backend, spm_pieces

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SUPPORTED_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
SPECIAL_ID_KEYS = ("bos", "eos", "unknown", "padding")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ``tokenizer.ggml.pre`` values whose split regex differs from GPT-2's; others use GPT-2's.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _check_metadata(md: Mapping[str, Any]) -> str:
    """The tokenizer kind, after checking what every kind needs; else ModelLoadError."""
    kind = md.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        supported = ", ".join(f"{k!r} ({v})" for k, v in SUPPORTED_MODELS.items())
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.model = {kind!r} is not supported (supported: {supported}); "
            "load the model from a Hugging Face folder with a tokenizer.json instead"
        )
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF tokenizer metadata lacks tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError("GGUF tokenizer.ggml.tokens is not an array of strings")
    for key in SPECIAL_ID_KEYS:
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and (not isinstance(tid, int) or not 0 <= tid < len(tokens)):
            raise ModelLoadError(
                f"GGUF tokenizer.ggml.{key}_token_id = {tid!r} is not an id of the "
                f"{len(tokens)}-token vocabulary"
            )
    return str(kind)


def build_backend_from_gguf(md: Mapping[str, Any]) -> BackendTokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the tokenizer the metadata describes."""
    kind = _check_metadata(md)
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    if kind == "llama":
        backend = build_spm_backend(md)
        vocab = set(spm_pieces(md))
        byte_level = False
    else:
        backend = _byte_level_backend(md)
        vocab = set(backend.get_vocab())
        byte_level = True
    alphabet = set(bytes_to_unicode().values())
    types: list[int] = md.get("tokenizer.ggml.token_type") or []
    special_ids = {
        md[f"tokenizer.ggml.{k}_token_id"]
        for k in SPECIAL_ID_KEYS
        if isinstance(md.get(f"tokenizer.ggml.{k}_token_id"), int)
    }
    # A control token outside GPT-2's byte alphabet is a llama.cpp mislabel in a byte-level
    # vocabulary (it would grow the vocabulary); transformers skips it too.
    special = [
        AddedToken(t, normalized=False, special=True)
        for i, (t, ty) in enumerate(zip(tokens, types, strict=False))
        if (ty == TOKEN_TYPE_CONTROL or i in special_ids) and (not byte_level or set(t) <= alphabet)
    ]
    if kind == "llama":  # the special ids whatever their type (SentencePiece's <unk> is 2)
        special += [AddedToken(tokens[i], normalized=False, special=True) for i in special_ids]
    backend.add_special_tokens(list({a.content: a for a in special}.values()))
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == TOKEN_TYPE_USER_DEFINED and t in vocab
    ]
    backend.add_tokens(user)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token"))
    _set_post_processor(backend, md, tokens, add_bos, add_eos)
    return backend


def _byte_level_backend(md: Mapping[str, Any]) -> BackendTokenizer:
    """GPT-2 style byte-level BPE: tokens spelled in GPT-2's byte alphabet, merges given."""
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    merges_raw = md.get("tokenizer.ggml.merges") or []
    if not isinstance(merges_raw, list) or not all(isinstance(m, str) for m in merges_raw):
        raise ModelLoadError("GGUF tokenizer.ggml.merges is not an array of strings")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if sep:
            merges.append((left, right))
    backend = BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(md.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _set_post_processor(
    backend: BackendTokenizer,
    md: Mapping[str, Any],
    tokens: list[str],
    add_bos: bool,
    add_eos: bool,
) -> None:
    """Add BOS/EOS around encoded text when the GGUF asks for it (``add_bos_token``...)."""
    around: dict[str, tuple[str, int] | None] = {"bos": None, "eos": None}
    for key, wanted in (("bos", add_bos), ("eos", add_eos)):
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if wanted and isinstance(tid, int):
            around[key] = (tokens[tid], tid)
    bos, eos = around["bos"], around["eos"]
    if bos is None and eos is None:
        return

    def seq(x: str, type_id: int) -> str:
        parts = [f"{bos[0]}:{type_id}"] if bos else []
        return " ".join([*parts, f"${x}:{type_id}", *([f"{eos[0]}:{type_id}"] if eos else [])])

    backend.post_processor = processors.TemplateProcessing(
        single=seq("A", 0),
        pair=f"{seq('A', 0)} {seq('B', 1)}",
        special_tokens=list(dict.fromkeys(t for t in (bos, eos) if t is not None)),
    )
