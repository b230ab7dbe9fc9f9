"""Responses API output: the items of a finished answer and the streamed events.

An answer becomes OpenAI's output items, in this order: a ``reasoning`` item (with
``--reasoning-parser``, when the model reasoned: ``content`` of one ``reasoning_text``
part), a ``message`` item (one ``output_text`` part; left out when the answer is only
tool calls), then one ``function_call`` item per call (``call_id`` is the chat path's
``call_...`` id). Item ids are ``rs_`` / ``msg_`` / ``fc_`` + random hex.

A stream is Server-Sent Events ``event: <type>`` / ``data: <json>``, each event carrying
its ``type`` and a ``sequence_number`` counting from 0 (OpenAI's and vLLM's shapes)::

    response.created, response.in_progress
    response.output_item.added (reasoning)  response.reasoning_text.delta ... .done
    response.output_item.done
    response.output_item.added (message)    response.content_part.added
    response.output_text.delta ...          response.output_text.done
    response.content_part.done              response.output_item.done
    response.output_item.added (function_call)
    response.function_call_arguments.delta  response.function_call_arguments.done
    response.output_item.done
    response.completed (or response.incomplete)  -- the whole response, as GET returns it

``EventWriter`` opens an item when the kind of text changes and closes it when the next
begins or the answer ends, so the items of ``response.completed`` are what the deltas
spelled, and equal what the same text gives unstreamed (the reasoning and tool-call
streamers keep that invariant: ``reasoning_parsers/base.py``, ``tool_parsers/streaming.py``).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from kvstack.serve.chat.tool_parsers import ToolCall, ToolCallDelta


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def reasoning_item(text: str, rid: str | None = None) -> dict[str, Any]:
    return {
        "id": rid or item_id("rs"), "type": "reasoning", "summary": [],
        "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
        "status": "completed",
    }  # fmt: skip


def message_item(text: str, mid: str | None = None, status: str = "completed") -> dict[str, Any]:
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": parts}  # fmt: skip


def call_item(call: ToolCall, fid: str | None = None) -> dict[str, Any]:
    return {"id": fid or item_id("fc"), "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}  # fmt: skip


def output_items(
    reasoning: str | None, content: str | None, calls: list[ToolCall]
) -> list[dict[str, Any]]:
    """The output items of a finished answer (see the module)."""
    items = [reasoning_item(reasoning)] if reasoning else []
    if content or not calls:
        items.append(message_item(content or ""))
    return items + [call_item(c) for c in calls]


class EventWriter:
    """One response's events: ``sequence_number`` in order, items opened and closed."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self._open: dict[str, Any] | None = None
        self._text = ""  # text of the open item

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def lifecycle(self, kind: str, response: dict[str, Any]) -> str:
        return self.event(kind, response=response)

    def reasoning(self, delta: str) -> list[str]:
        out = self._switch("reasoning") if delta else []
        if delta:
            self._text += delta
            out.append(self.event("response.reasoning_text.delta", **self._where(), delta=delta))
        return out

    def text(self, delta: str) -> list[str]:
        out = self._switch("message") if delta else []
        if delta:
            self._text += delta
            out.append(self.event("response.output_text.delta", **self._where(),
                                  delta=delta, logprobs=[]))  # fmt: skip
        return out

    def call(self, d: ToolCallDelta) -> list[str]:
        out: list[str] = []
        if d.id is not None:  # a new call's header
            out += self.close()
            item = call_item(ToolCall(d.id, d.name or "", ""))
            item["status"] = "in_progress"
            out += self._add(item)
        if d.arguments and self._open is not None:
            self._text += d.arguments
            kind = "response.function_call_arguments.delta"
            out.append(self.event(kind, item_id=self._open["id"],
                                  output_index=len(self.items), delta=d.arguments))  # fmt: skip
        return out

    def close(self) -> list[str]:
        """Close the open item (its ``done`` events)."""
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        where = {"item_id": item["id"], "output_index": len(self.items)}
        out = []
        if item["type"] == "reasoning":
            item = reasoning_item(text, item["id"])
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=text))  # fmt: skip
        elif item["type"] == "message":
            item = message_item(text, item["id"])
            part = item["content"][0]
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=text, logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))  # fmt: skip
        else:
            item = {**item, "arguments": text, "status": "completed"}
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=text))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=len(self.items),
                              item=item))  # fmt: skip
        self.items.append(item)
        return out

    def finish(self) -> list[str]:
        """Close the open item; an answer with no message and no call still gets an
        empty message item, as ``output_items`` gives it."""
        out = self.close()
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            out += self._switch("message") + self.close()
        return out

    def _switch(self, kind: str) -> list[str]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self.close()
        if kind == "reasoning":
            item = {**reasoning_item("", None), "content": [], "status": "in_progress"}
            return out + self._add(item)
        item = {**message_item("", None, "in_progress"), "content": []}
        out += self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out.append(self.event("response.content_part.added", **self._where(), part=part))
        return out

    def _add(self, item: dict[str, Any]) -> list[str]:
        self._open, self._text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.items),
                           item=item)]  # fmt: skip

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items), "content_index": 0}
