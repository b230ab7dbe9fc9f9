"""A chat request's prompt: its messages through the model's chat template (one path
for chat completions, ``/tokenize``, pins and the agent workload, so a pinned prefix is
exactly the tokens a chat computes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.core.errors import InvalidRequestError
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.serve.chat.documents import with_documents
from kvstack.serve.chat.tool_calls import ToolPlan
from kvstack.serve.chat.tool_prompt import fallback_messages, template_supports_tools

if TYPE_CHECKING:
    from kvstack.serve.chat.messages import ChatMessage


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (``developer`` as ``system``, parts
    joined): one function for chat completions, ``/tokenize`` and pins, so a pinned
    prefix is exactly the tokens a chat computes. Empty content is a 400 but on an
    assistant message."""
    out = []
    for i, m in enumerate(messages):
        if not m.text() and m.role != "assistant":
            raise InvalidRequestError(
                f"messages[{i}] ({m.role}) has empty content", param=f"messages.{i}.content"
            )
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(
                "only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls"
            )
        out.append(m.template_dict())
    return out


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    plan: ToolPlan | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation through the model's chat template, with its tools
    rendered by ``plan`` and its ``documents`` (the template's own sections, or the
    fallbacks of ``tool_prompt.py`` and ``documents.py`` for a template without them)."""
    text = chat_prompt_text(
        tokenizer, messages, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs, plan=plan, documents=documents,
    )  # fmt: skip
    return tokenizer.encode(text, add_special_tokens=False)  # as apply_chat_template does


def chat_prompt_text(tokenizer: Tokenizer, messages: list[ChatMessage], **kw: Any) -> str:
    """The rendered text ``chat_prompt_ids`` tokenizes (keywords as ``render_dicts``)."""
    return render_dicts(tokenizer, template_messages(messages), **kw)


def render_dicts(
    tokenizer: Tokenizer,
    msgs: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    plan: ToolPlan | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """``chat_prompt_text`` of messages already as the template sees them."""
    template = tokenizer.chat_template or ""
    tools = None
    if plan is not None:
        msgs, tools = plan.render(msgs, template)
    elif not template_supports_tools(template) and any(
        m.get("tool_calls") or m["role"] == "tool" for m in msgs
    ):  # a tool conversation continued without tools: its calls still reach the prompt
        msgs = fallback_messages(msgs, [])
    msgs, docs = with_documents(msgs, documents, template)
    text = tokenizer.apply_chat_template(
        msgs, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tokenize=False, tools=tools,
        documents=docs, **(chat_template_kwargs or {}),
    )  # fmt: skip
    assert isinstance(text, str)
    return text
