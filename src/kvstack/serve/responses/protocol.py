"""The ``POST /v1/responses`` body (OpenAI's Responses API as vLLM serves it) and its
translation to the chat path: input items to chat-template messages, Responses tools to
chat tools, ``text.format`` to ``response_format``.

Input items (``input`` may also be one string, a user message):

* messages (``{"role", "content"}``, ``type`` "message" or absent): content is a string or
  a list of ``input_text`` / ``output_text`` / ``text`` parts, joined as chat joins them;
* ``function_call`` (an earlier call: ``call_id``, ``name``, ``arguments``): joins the
  assistant message before it, as the chat template expects ``tool_calls``;
* ``function_call_output`` (``call_id``, ``output``): a ``tool`` message;
* ``reasoning`` (``content`` of ``reasoning_text`` parts): the next assistant message's
  ``reasoning_content`` (the field Qwen3's template reads).

Images, files and hosted tools (web search, file search, MCP, code interpreter) are
refused with a 400 naming the field, as vLLM refuses them without a tool server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from kvstack.core.errors import InvalidRequestError
from kvstack.model.tokenizer.chat_template import join_text_parts
from kvstack.serve.api.protocol import ChatCompletionRequest
from kvstack.serve.api.protocol_tools import MAX_TOOLS, StructuredOutputsField

TEXT_PARTS = ("input_text", "output_text", "text")


class _Strict(BaseModel):
    """Known fields typed; unknown ones kept aside and reported (``protocol.ignored_fields``)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None
    summary: str | None = None


class ResponsesTool(_Strict):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    """OpenAI's ``ResponseCreateParams`` fields vLLM reads, plus vLLM's sampling extras."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: StrictBool = True
    stream: StrictBool = False
    background: StrictBool = False
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Extension: vLLM's ``structured_outputs`` as chat completions take it (one constraint
    # per request: not together with ``text.format`` json).
    structured_outputs: StructuredOutputsField | None = None

    def chat_request(self, model: str | None) -> ChatCompletionRequest:
        """The chat request whose sampling, tools and constraint this turn runs with (its
        messages are a placeholder: the prompt is rendered from ``input_messages``)."""
        if self.background:
            raise InvalidRequestError(
                "background mode is not supported (responses run while the request waits)",
                param="background",
            )
        body: dict[str, Any] = {
            "model": model, "messages": [{"role": "user", "content": "-"}],
            "max_tokens": self.max_output_tokens, "stream": self.stream,
        }  # fmt: skip
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                     "stop", "parallel_tool_calls", "user", "cache_salt",
                     "chat_template_kwargs"):  # fmt: skip
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.structured_outputs is not None:
            body["structured_outputs"] = self.structured_outputs.model_dump(
                by_alias=True, exclude_none=True
            )
        if self.top_logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise InvalidRequestError(
                    "text.format json_schema needs a schema", param="text.format.schema"
                )
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_},
            }
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:  # e.g. a tool name the chat path refuses
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            param = loc.replace(".function.", ".").replace("max_tokens", "max_output_tokens")
            raise InvalidRequestError(f"{param}: {first['msg']}", param=param) from None

    def input_messages(self) -> list[dict[str, Any]]:
        """This turn's input items as chat-template messages (see the module)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequestError("input is empty", param="input")
        out: list[dict[str, Any]] = []
        reasoning: str | None = None
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "reasoning":
                parts = item.get("content") or []
                if not isinstance(parts, list):
                    raise InvalidRequestError(
                        "reasoning content must be a list of parts", param=f"input.{i}.content"
                    )
                reasoning = join_text_parts([_text(p, f"input.{i}.content") for p in parts])
            elif kind == "message":
                msg = _message(item, i)
                if msg["role"] == "assistant" and reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
            elif kind == "function_call":
                fn = {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}
                call = {"id": _str(item, "call_id", i), "type": "function", "function": fn}
                last = out[-1] if out else None
                if last is None or last["role"] != "assistant":  # calls join the answer
                    last = {"role": "assistant", "content": ""}
                    out.append(last)
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                last.setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                output = item.get("output")
                if not isinstance(output, str):
                    raise InvalidRequestError(
                        "function_call_output needs a string output", param=f"input.{i}.output"
                    )
                out.append({"role": "tool", "tool_call_id": _str(item, "call_id", i),
                            "content": output})  # fmt: skip
            else:
                raise InvalidRequestError(
                    f"input items of type {kind!r} are not supported", param=f"input.{i}.type"
                )
        return out


def _chat_tool(tool: ResponsesTool, i: int) -> dict[str, Any]:
    if tool.type != "function":
        raise InvalidRequestError(
            f"tools of type {tool.type!r} are not supported (no tool server): only "
            "function tools", param=f"tools.{i}.type",
        )  # fmt: skip
    if not tool.name:
        raise InvalidRequestError("a function tool needs a name", param=f"tools.{i}.name")
    fn = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequestError(
            f"input message role must be user, system, developer or assistant, got {role!r}",
            param=f"input.{i}.role",
        )
    content = item.get("content")
    if isinstance(content, list):
        content = join_text_parts([_text(p, f"input.{i}.content") for p in content])
    if not isinstance(content, str):
        raise InvalidRequestError("message content must be text", param=f"input.{i}.content")
    if not content and role != "assistant":
        raise InvalidRequestError(f"input.{i} ({role}) has empty content", f"input.{i}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in (*TEXT_PARTS, "reasoning_text"):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidRequestError(f"content parts of type {kind!r} are not supported", where)
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError("a text part needs a string text", param=where)
    return text


def _str(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"input.{i} needs a string {key}", param=f"input.{i}.{key}")
    return value
