"""The token ids a replica will see for an OpenAI request body, computed at the router.

A KV-aware router must hash exactly the tokens the engine will hash, so it tokenizes
the same way ``serve/api/routes_openai.py`` does: a completion's (first) prompt with
``tokenizer.encode`` or as given ids, a chat with ``ChatCompletionRequest.prompt_ids``
(the model's chat template, as the replica renders it) or, when its tools, documents or
marked parts are segments, ``ChatCompletionRequest.segments`` (each segment tokenized on
its own, as a replica with segment reuse on, the default, tokenizes it; a replica with
``--segment-cache none`` tokenizes the whole text, which can differ at a segment's edge).
A body the router cannot parse is not its business: it returns None and the request is
routed by load; the replica answers the 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvstack.core.errors import KvstackError
from kvstack.serve.api.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class PromptInfo:
    token_ids: list[int]
    cache_salt: str | None
    stream: bool
    segments: tuple[tuple[Any, ...], ...] = ()  # (start, end[, primer ids])
    sink: tuple[int, ...] = ()


def prompt_info(tokenizer: Any, path: str, body: bytes) -> PromptInfo | None:
    """Token ids, cache salt and stream flag of a request to ``path``; None if unparsable."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            return None
        if path.endswith("/chat/completions"):
            chat = ChatCompletionRequest.model_validate(data)
            chat.tool_plan()  # tools are rendered as the replica renders them (hermes)
            seg = chat.segments(tokenizer)
            if seg is None:
                return PromptInfo(chat.prompt_ids(tokenizer), chat.cache_salt, chat.stream)
            bos = getattr(tokenizer, "bos_token_id", None)
            sink = (bos,) if bos is not None else ()
            return PromptInfo(seg[0], chat.cache_salt, chat.stream, tuple(seg[1]), sink)
        comp = CompletionRequest.model_validate(data)
        first = comp.prompts()[0]
        ids = tokenizer.encode(first) if isinstance(first, str) else list(first)
        return PromptInfo(ids, comp.cache_salt, comp.stream)
    except (ValueError, ValidationError, KvstackError, IndexError, TypeError, RecursionError):
        return None
