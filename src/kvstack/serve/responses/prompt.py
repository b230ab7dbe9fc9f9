"""The prompt of one Responses turn: instructions, the stored conversation, the new input.

``strip`` (the default, ``--reasoning-history``): the whole conversation goes through the
chat template, as a chat completion's would. Templates that drop earlier turns'
reasoning (Qwen3's renders ``<think>`` only after the last user message) then change
the previous answer's tokens, so the prefix cache matches only up to the previous
prompt and the previous answer (its reasoning and its text) is computed again.

``keep``: the previous turn's exact tokens -- its prompt and every token it generated,
reasoning included -- are the start of the new prompt, and only what follows the
previous answer is rendered: the template's end of that answer and the new messages.
That part is found by rendering the conversation with a sentinel in place of the
previous answer and taking the text after the sentinel; the end-of-turn text the model
already generated (its stop token) is not repeated. When the sentinel cannot be found
exactly once (a template that rewrites assistant content), the turn falls back to
``strip``. The model then sees its own earlier reasoning, which Qwen3 was not trained
to see: ``keep`` trades that for reuse (docs/responses.md has the measured costs).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.serve.chat.prompt import render_dicts
from kvstack.serve.chat.tool_calls import ToolPlan
from kvstack.serve.responses.store import StoredResponse

logger = logging.getLogger("kvstack.serve")
SENTINEL = "\x00kvstack-previous-answer\x00"


def turn_messages(
    instructions: str | None, prev: StoredResponse | None, new: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the messages to render, the conversation to store): ``instructions`` lead this
    turn only (OpenAI: they are not carried over to the next one)."""
    history = [*(prev.messages if prev is not None else []), *new]
    head = [{"role": "system", "content": instructions}] if instructions else []
    return head + history, history


def render_key(
    instructions: str | None, plan: ToolPlan | None, template_kwargs: dict[str, Any] | None
) -> str:
    """What besides the stored conversation shapes a prompt: a turn may continue the
    previous turn's tokens only when this is the same for both."""
    tools = [t.model_dump(exclude_none=True) for t in plan.tools] if plan is not None else None
    return json.dumps([instructions, tools, template_kwargs], sort_keys=True, default=str)


def prompt_ids(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    plan: ToolPlan | None,
    template_kwargs: dict[str, Any] | None,
    prev: StoredResponse | None,
    keep_key: str | None,
) -> list[int]:
    """The turn's prompt. ``keep_key``: this turn's ``render_key`` under ``keep`` (None:
    ``strip``); the previous turn's tokens are continued when its key is the same."""
    kw: dict[str, Any] = {"plan": plan, "chat_template_kwargs": template_kwargs}
    if keep_key is not None and prev is not None and prev.render_key == keep_key:
        spliced = _continue_tokens(tok, messages, prev, kw)
        if spliced is not None:
            return spliced
    text = render_dicts(tok, messages, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


def _continue_tokens(
    tok: Tokenizer, messages: list[dict[str, Any]], prev: StoredResponse, kw: dict[str, Any]
) -> list[int] | None:
    """The previous turn's tokens + the rendering of what follows its answer, or None.
    ``messages`` ends with the stored conversation, whose last message is the previous
    answer, then this turn's input."""
    idx = next((i for i in range(len(messages) - 1, -1, -1)
                if messages[i] is prev.messages[-1]), None)  # fmt: skip
    if idx is None or not prev.output_ids:
        return None
    marked = list(messages)
    marked[idx] = {"role": "assistant", "content": SENTINEL}
    text = render_dicts(tok, marked, add_generation_prompt=True, **kw)
    if text.count(SENTINEL) != 1:
        logger.info("--reasoning-history keep: the template rewrote the answer; rendering it")
        return None
    after = text.split(SENTINEL, 1)[1]
    generated = tok.decode(prev.output_ids, skip_special_tokens=False)
    k = _written(generated, after)
    return [*prev.prompt_ids, *prev.output_ids, *tok.encode(after[k:], add_special_tokens=False)]


def _written(generated: str, after: str) -> int:
    """How much of ``after`` (the template's end of the answer and what follows) the
    model already wrote: the longest suffix of ``generated`` that begins ``after``."""
    for k in range(min(len(after), len(generated)), 0, -1):
        if generated.endswith(after[:k]):
            return k
    return 0
