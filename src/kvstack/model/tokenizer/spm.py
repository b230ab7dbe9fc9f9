"""SentencePiece BPE vocabularies from GGUF metadata (``tokenizer.ggml.model = "llama"``).

Llama-2, Mistral, TinyLlama and Gemma GGUF files carry a SentencePiece BPE vocabulary the
way llama.cpp's converter writes it::

    tokenizer.ggml.tokens      [str]    pieces, "▁" (U+2581) standing for a space
    tokenizer.ggml.scores      [float]  SentencePiece's piece scores (higher merges first)
    tokenizer.ggml.token_type  [int]    1 normal, 2 unknown, 3 control, 4 user-defined,
                                        5 unused, 6 byte (``<0x00>``..``<0xFF>``)
    tokenizer.ggml.add_space_prefix     SentencePiece's ``add_dummy_prefix`` (default true)

There are no merges in the file. SentencePiece's BPE (and llama.cpp's ``llm_tokenizer_spm``)
repeatedly joins the adjacent pair whose joined piece is in the vocabulary with the best
score; a ``tokenizers`` BPE model instead applies ranked merge rules. Making every split
``piece = left + right`` with both halves in the vocabulary a merge rule ranked by the
joined piece's score (``spm_merges``) turns the one into the other; it is also how
transformers turns a GGUF or a ``tokenizer.model`` into a fast tokenizer, and the ranking
below reproduces transformers' order, ties included, so the ids match
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (tests/model/test_tokenizer_spm.py
also checks them against ``sentencepiece`` on vocabularies it trains). Characters outside
the vocabulary become their UTF-8 byte tokens (SentencePiece's ``byte_fallback``), or the
unknown token when the file has no byte tokens.

Text handling follows transformers' GGUF conversion, by ``general.architecture``:

- ``gemma*``: no dummy prefix; spaces become "▁" (a normalizer); the vocabulary is ranked
  by position, not score (Gemma's scores do not follow its merge order), and
  whitespace-only pieces stored with real spaces are respelled with "▁".
- ``phi3``: "▁" prepended to every text segment and spaces replaced (a normalizer).
- anything else (``llama``, ``mistral``...): "▁" prepended to the first segment of the text
  only (``Metaspace`` with ``prepend_scheme="first"``), spaces replaced; the decoder strips
  the one leading space this added, as SentencePiece's decoder does. A file that says
  ``add_space_prefix = false`` gets no prefix and no strip (SentencePiece's semantics;
  transformers ignores that key).

Known differences from SentencePiece/llama.cpp that transformers has and kvstack keeps (to
give the same ids): text starting with a space gets no second "▁" (SentencePiece encodes
``" hi"`` as ``▁▁hi``, transformers as ``▁hi``), and text after a special token gets no
prefix (llama.cpp prefixes every segment that follows a special token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from kvstack.core.errors import ModelLoadError

SPACE = "\u2581"  # SentencePiece's "▁", the visible spelling of a space
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
PHI3_ARCHITECTURES = ("phi3",)


def spm_merges(vocab: Mapping[str, int], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merge rules equivalent to SentencePiece BPE over ``vocab``, best first.

    Every way to write a piece as ``left + right`` with both halves in ``vocab`` is a rule;
    rules are ordered by the joined piece's ``rank`` value (higher first), then by the
    longer left half, then by the longer right half, then by the order of ``rank``, then by
    the halves' ids -- the order transformers' conversion produces, so BPE ties resolve the
    same way.
    """
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for order, (piece, score) in enumerate(rank.items()):
        for cut in range(1, len(piece)):
            left = piece[:cut]
            left_id = vocab.get(left)
            if left_id is None:
                continue
            right = piece[cut:]
            right_id = vocab.get(right)
            if right_id is None:
                continue
            found.append((-score, -len(left), -len(right), order, left_id, right_id, left, right))
    found.sort(key=lambda m: m[:6])
    return [(m[6], m[7]) for m in found]


def _field(md: Mapping[str, Any], key: str, n: int, kind: type | tuple[type, ...]) -> list[Any]:
    """``md[key]`` checked to be a list of ``n`` values of ``kind``; else ModelLoadError."""
    value = md.get(key)
    if value is None:
        raise ModelLoadError(f"GGUF SentencePiece tokenizer: {key} is missing")
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ModelLoadError(f"GGUF SentencePiece tokenizer: {key} is not an array")
    if len(value) != n:
        raise ModelLoadError(
            f"GGUF SentencePiece tokenizer: {key} has {len(value)} entries, "
            f"tokenizer.ggml.tokens has {n}"
        )
    bad = next((i for i, v in enumerate(value) if not isinstance(v, kind)), None)
    if bad is not None:
        raise ModelLoadError(
            f"GGUF SentencePiece tokenizer: {key}[{bad}] = {value[bad]!r} has the wrong type"
        )
    return list(value)


def _is_gemma(md: Mapping[str, Any]) -> bool:
    return md.get("general.architecture") in GEMMA_ARCHITECTURES


def spm_pieces(md: Mapping[str, Any]) -> list[str]:
    """The vocabulary's pieces as the backend spells them (Gemma's spaces respelled)."""
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    if _is_gemma(md):
        # Gemma stores pieces of two or more spaces with real spaces; the text side sees "▁".
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    return tokens


def build_spm_backend(md: Mapping[str, Any]) -> BackendTokenizer:
    """The ``tokenizers`` model, normalizer, pre-tokenizer and decoder of a SentencePiece BPE.

    Special and user-defined tokens and BOS/EOS are added by the caller
    (``tokenizer_gguf.build_backend_from_gguf``), the same for every tokenizer kind.
    """
    tokens = md["tokenizer.ggml.tokens"]
    n = len(tokens)
    scores = _field(md, "tokenizer.ggml.scores", n, (int, float))
    _field(md, "tokenizer.ggml.token_type", n, int)
    pieces = spm_pieces(md)
    vocab = {piece: i for i, piece in enumerate(pieces)}  # a repeated piece keeps its last id
    rank: dict[str, float]
    if _is_gemma(md):
        rank = {piece: -float(i) for i, piece in enumerate(pieces)}
    else:
        rank = {piece: float(s) for piece, s in zip(pieces, scores, strict=True)}
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = pieces[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < n else None
    backend = BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=spm_merges(vocab, rank),
            unk_token=unk,
            fuse_unk=True,  # SentencePiece emits one unknown id for a run of unknown chars
            byte_fallback=True,
            dropout=None,
        )
    )
    arch = md.get("general.architecture")
    prefix = md.get("tokenizer.ggml.add_space_prefix", True) is not False
    fuse = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if _is_gemma(md):
        backend.normalizer = normalizers.Replace(" ", SPACE)
        prefix = False
    elif arch in PHI3_ARCHITECTURES and prefix:
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
    strip = [decoders.Strip(content=" ", left=1, right=0)] if prefix else []
    backend.decoder = decoders.Sequence([*fuse, *strip])
    return backend
