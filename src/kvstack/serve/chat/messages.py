"""Chat messages as the OpenAI API spells them, and the strict base of every request body.

``StrictBody`` types the fields a body declares strictly and keeps unknown ones aside, so
``ignored_fields`` can report them (vLLM accepts and ignores unknown fields; kvstack names
them in a response header). ``ChatMessage`` renders itself for a chat template.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, field_validator

from kvstack.model.tokenizer.chat_template import join_text_parts, template_role
from kvstack.serve.api.protocol_tools import ToolCallMessage

MAX_CONTENT_PARTS = 1024  # per message, checked before any templating (SECURITY.md)


class StrictBody(BaseModel):
    """Known fields strictly typed; unknown ones kept aside and reported (``ignored_fields``)."""

    model_config = ConfigDict(extra="allow")


def ignored_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """Dotted paths of the fields of ``body`` (nested models and lists included) that no
    model declares, in the order they appear."""
    out = [f"{prefix}{name}" for name in body.model_extra or {}]
    for name in type(body).model_fields:
        out += _ignored_in(getattr(body, name), f"{prefix}{name}.")
    return out


def _ignored_in(value: Any, prefix: str) -> list[str]:
    if isinstance(value, BaseModel):
        return ignored_fields(value, prefix)
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _ignored_in(v, f"{prefix}{i}.")]
    return []


class TextPart(StrictBody):
    type: Literal["text"]
    text: str
    kvstack_segment: StrictBool = False  # segment reuse: this part's KV at any offset


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages
    # An earlier answer's reasoning (vLLM's ``reasoning``; ``reasoning_content`` before
    # vLLM 0.11): the template sees it as ``reasoning_content``, which Qwen3's reads.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts_bounded(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(
                f"a message may have at most {MAX_CONTENT_PARTS} content parts, got {len(v)}"
            )
        return v

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (``developer`` becomes ``system``)."""
        out: dict[str, Any] = {"role": template_role(self.role), "content": self.text()}
        if (thought := self.reasoning or self.reasoning_content) is not None:
            out["reasoning_content"] = thought
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out

    def text(self) -> str:
        """The content as one text: parts joined as ``LLM.chat`` joins them."""
        if isinstance(self.content, list):
            return join_text_parts([p.text for p in self.content])
        return self.content or ""
