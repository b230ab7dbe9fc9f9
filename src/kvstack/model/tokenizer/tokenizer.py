"""Tokenizer: GGUF metadata or a Hugging Face ``tokenizer.json``, special tokens and chat.

``Tokenizer.from_gguf`` rebuilds the tokenizer a GGUF file describes
(``kvstack.model.tokenizer.gguf``: byte-level BPE, ``tokenizer.ggml.model = "gpt2"``, or
SentencePiece BPE, ``"llama"``, built in ``kvstack.model.tokenizer.spm``) with the
``tokenizers`` library the way transformers rebuilds it, so token ids match
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``. Control tokens become special added
tokens, so ``"<|im_start|>"`` or ``"<start_of_turn>"`` in text encodes to its single id.
``tokenizer.chat_template`` is the chat template.

Chat templates are rendered by ``kvstack.model.tokenizer.chat_template`` (a sandboxed Jinja2
environment configured like transformers').
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from kvstack.core.errors import InvalidRequestError, ModelLoadError
from kvstack.model.tokenizer.chat_template import render_chat_template
from kvstack.model.tokenizer.gguf import build_backend_from_gguf, bytes_to_unicode

__all__ = ["Tokenizer", "build_backend_from_gguf", "bytes_to_unicode"]

# Tokens that end a chat turn in common templates; counted as EOS when the template uses them.
TURN_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class Tokenizer:
    """Token ids <-> text, special tokens, EOS set and chat template of one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        source: str = "",
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.unk_token_id = unk_token_id
        self.pad_token_id = pad_token_id
        self.source = source
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        eos = set(extra_eos_token_ids)
        if eos_token_id is not None:
            eos.add(eos_token_id)
        self._model_eos = frozenset(eos)
        self.set_chat_template(chat_template)

    def set_chat_template(self, chat_template: str | None) -> None:
        """Use ``chat_template`` (``--chat-template``); the EOS set follows it: the model's
        EOS ids plus the turn-end tokens (``<|im_end|>``...) the template writes."""
        self.chat_template = chat_template
        eos = set(self._model_eos)
        for piece in TURN_END_TOKENS:
            tid = self.backend.token_to_id(piece)
            if tid is not None and chat_template and piece in chat_template:
                eos.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], source: str = "gguf") -> Tokenizer:
        """Build from a GGUF file's ``tokenizer.*`` metadata."""
        backend = build_backend_from_gguf(md)
        ids = {
            k: md.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")
        }
        return cls(
            backend,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            unk_token_id=ids["unknown"],
            pad_token_id=ids["padding"],
            chat_template=md.get("tokenizer.chat_template"),
            source=source,
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Build from the metadata of the GGUF file at ``path``."""
        from kvstack.model.loader.gguf_reader import GGUFFile

        with GGUFFile.open(path) as g:  # the header only: no tensor is read
            return cls.from_gguf_metadata(g.metadata, source=str(path))

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder's ``tokenizer.json`` (+ ``tokenizer_config.json``,
        ``chat_template.jinja``, ``generation_config.json``, ``config.json`` when present)."""
        root = Path(folder)
        if not (root / "tokenizer.json").is_file():
            raise ModelLoadError(f"{root}: no tokenizer.json (a fast tokenizer file is required)")
        try:
            backend = BackendTokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # the Rust side raises plain Exception on bad JSON
            raise ModelLoadError(f"{root / 'tokenizer.json'}: cannot be parsed ({e})") from e

        def read_json(name: str) -> dict[str, Any]:
            p = root / name
            if not p.is_file():
                return {}
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{p}: invalid JSON ({e})") from e
            return data if isinstance(data, dict) else {}

        tcfg, gen, mcfg = (
            read_json(n) for n in ("tokenizer_config.json", "generation_config.json", "config.json")
        )
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")

        def token_id(key: str) -> int | None:
            piece = _token_str(tcfg.get(key))
            tid = backend.token_to_id(piece) if piece is not None else None
            if tid is None and isinstance(mcfg.get(f"{key}_id"), int):
                tid = mcfg[f"{key}_id"]
            return tid

        extra: list[int] = []
        for src in (gen, mcfg):
            value = src.get("eos_token_id")
            extra += (
                [value]
                if isinstance(value, int)
                else [v for v in value or [] if isinstance(v, int)]
            )
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=token_id("eos_token"),
            unk_token_id=token_id("unk_token"),
            pad_token_id=token_id("pad_token"),
            chat_template=template if isinstance(template, str) else None,
            extra_eos_token_ids=extra,
            source=str(root),
        )

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (Hugging Face layout)."""
        root = Path(folder)
        root.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(root / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, tid in (
            ("bos_token", self.bos_token_id),
            ("eos_token", self.eos_token_id),
            ("unk_token", self.unk_token_id),
            ("pad_token", self.pad_token_id),
        ):
            cfg[key] = self.backend.id_to_token(tid) if tid is not None else None
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (root / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    # ----------------------------------------------------------------- ids <-> text
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the model asks."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def is_special(self, token_id: int) -> bool:
        """True for special/control tokens (skipped by ``decode(skip_special_tokens=True)``)."""
        return token_id in self._special_ids

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` (byte-level spelling, e.g. ``"Ġworld"``)."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            raise InvalidRequestError(f"token id {token_id} is outside the vocabulary")
        return str(piece)

    # ----------------------------------------------------------------- chat
    def special_tokens_map(self) -> dict[str, str]:
        """``bos_token``/``eos_token``/``unk_token``/``pad_token`` strings, for templates."""
        out = {}
        for key, tid in (
            ("bos_token", self.bos_token_id),
            ("eos_token", self.eos_token_id),
            ("unk_token", self.unk_token_id),
            ("pad_token", self.pad_token_id),
        ):
            if tid is not None and (piece := self.backend.id_to_token(tid)) is not None:
                out[key] = piece
        return out

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the model's chat template, like transformers does.

        With ``tokenize=True`` returns ids (encoded without adding BOS/EOS: the template
        writes whatever special tokens it wants). ``continue_final_message``: see
        ``render_chat_template``.
        """
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if clash:  # would be "got multiple values for argument ..." (a TypeError, a 500)
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {clash}", param="chat_template_kwargs"
            )
        source = chat_template or self.chat_template
        if not source:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt (completions) instead"
            )
        text = render_chat_template(
            source,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            **{**self.special_tokens_map(), **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, source={self.source!r})"


def _named_parameters(*fns: Callable[..., Any]) -> frozenset[str]:
    return frozenset(
        name
        for fn in fns
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )


# Names a client's ``chat_template_kwargs`` may not use: the parameters of the render
# path (derived from the signatures, so a new parameter is reserved the day it is added).
RESERVED_TEMPLATE_KWARGS = _named_parameters(
    Tokenizer.apply_chat_template, render_chat_template
) | {"messages"}
