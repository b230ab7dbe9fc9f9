"""Prompt inputs of ``LLM.generate`` as vLLM spells them (``vllm/inputs/data.py``).

A prompt is a string, a ``TextPrompt`` dict (``{"prompt": str}``), a ``TokensPrompt``
dict (``{"prompt_token_ids": [int, ...]}``; current vLLM's only way to pass token ids),
or, as kvstack has always accepted, a list of token ids. Both dicts may carry
``cache_salt`` (vLLM's prefix-cache isolation). ``generate`` takes one prompt or a list
of them, mixed. What kvstack cannot honour (``multi_modal_data``,
``mm_processor_kwargs``, ``token_type_ids``; any other key) is an
``InvalidRequestError`` naming the key, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from kvstack.core.errors import InvalidRequestError

TEXT_KEYS = frozenset({"prompt", "cache_salt"})
TOKENS_KEYS = frozenset({"prompt_token_ids", "prompt", "cache_salt"})
UNSUPPORTED = {
    "multi_modal_data": "kvstack serves text-only models",
    "mm_processor_kwargs": "kvstack serves text-only models",
    "token_type_ids": "kvstack's decoder models take no token type ids",
    "prompt_embeds": "kvstack takes token ids, not embeddings",
}


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: ``{"prompt": text}`` (``from kvstack import TextPrompt``)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """vLLM's ``TokensPrompt``: ``{"prompt_token_ids": ids}``, with the text it came from
    optionally (``from kvstack import TokensPrompt``)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


@dataclass(frozen=True)
class PromptInput:
    """One prompt: its text (None for token ids only), its token ids (None: tokenize the
    text), and its cache salt. Exactly one of ``text`` / ``token_ids`` is needed."""

    text: str | None
    token_ids: list[int] | None
    cache_salt: str | None = None


def parse_prompts(prompts: Any) -> list[PromptInput]:
    """The prompts of ``generate(prompts)``: one prompt or a sequence of them."""
    if isinstance(prompts, str | Mapping) or _is_token_list(prompts):
        return [parse_prompt(prompts)]
    if isinstance(prompts, Sequence):
        return [parse_prompt(p) for p in prompts]
    raise InvalidRequestError(
        "prompts must be a string, a TextPrompt / TokensPrompt dict, token ids, or a list "
        f"of them; got {type(prompts).__name__}"
    )


def parse_prompt(p: Any) -> PromptInput:
    if isinstance(p, str):
        return PromptInput(p, None)
    if _is_token_list(p):
        return PromptInput(None, list(p))
    if not isinstance(p, Mapping):
        raise InvalidRequestError(f"a prompt must be a string or a dict, got {type(p).__name__}")
    for key in p:
        if key in UNSUPPORTED:
            raise InvalidRequestError(f"prompt key {key!r} is not supported: {UNSUPPORTED[key]}")
    salt = p.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError("cache_salt must be a string")
    check_cache_salt(salt)
    if "prompt_token_ids" in p:
        _only(p, TOKENS_KEYS, "TokensPrompt")
        ids = p["prompt_token_ids"]
        if not _is_token_list(ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers")
        text = p.get("prompt")
        return PromptInput(text if isinstance(text, str) else None, list(ids), salt)
    if "prompt" in p:
        _only(p, TEXT_KEYS, "TextPrompt")
        if not isinstance(p["prompt"], str):
            raise InvalidRequestError("TextPrompt 'prompt' must be a string")
        return PromptInput(p["prompt"], None, salt)
    raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")


def _only(p: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    for key in p:
        if key not in allowed:
            raise InvalidRequestError(
                f"unknown {what} key {key!r}; keys are: {', '.join(sorted(allowed))}"
            )


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    ) and bool(x)  # fmt: skip


MAX_CACHE_SALT_LENGTH = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")


def check_cache_salt(v: str | None) -> str | None:
    """vLLM 0.32's ``validate_cache_salt``: a non-empty string of at most 128 characters
    without ``@ / \\`` or NUL (an empty salt would hash like none: vLLM refuses it)."""
    if v is None:
        return v
    if not v:
        raise InvalidRequestError(
            "'cache_salt' must be a non-empty string if provided", param="cache_salt"
        )
    if len(v) > MAX_CACHE_SALT_LENGTH or CACHE_SALT_FORBIDDEN & set(v):
        raise InvalidRequestError(
            "'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL",
            param="cache_salt",
        )
    return v
