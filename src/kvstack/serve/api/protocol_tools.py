"""OpenAI request fields for structured outputs and tools (and vLLM's ``guided_*``).

``response_format`` (OpenAI), ``structured_outputs`` (vLLM >= 0.10) and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` all become one
``StructuredOutputsParams``; a request may use one of them. ``param`` in every error is
the field the client sent, so ``response_format.json_schema.schema`` is blamed for a bad
schema, ``guided_regex`` for a bad regex. Tools (``tools``, ``tool_choice``,
``parallel_tool_calls``) and tool messages are typed here; ``chat/tool_calls.py`` turns them
into a prompt, a constraint and parsed calls.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from kvstack.core.errors import InvalidRequestError
from kvstack.core.structured_outputs import StructuredOutputsParams

MAX_TOOLS = 128


class _Body(BaseModel):
    # Unknown fields are kept aside and reported (``chat/messages.ignored_fields``), as vLLM
    # accepts them: e.g. the ``index`` clients keep on streamed tool_calls.
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's ``structured_outputs`` request field (``StructuredOutputsParams``)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    whitespace_pattern: str | None = None


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCallMessage(_Body):
    """An assistant message's ``tool_calls`` entry (arguments as JSON text)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class StructuredFields(BaseModel):
    """Mixin of the sampling request bodies: every spelling of an output constraint."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's per-request guided_decoding_backend is not a field: the engine has one
    # backend (--structured-outputs-backend), so the field is reported as ignored.

    def structured_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint, or None; 400 naming the fields if several. The
        constraint itself is validated once, by the engine (``SamplingParams.validate``)."""
        found = [p for p in self._constraints() if p is not None]
        if len(found) > 1:
            names = ", ".join(p.param for p in found)
            raise InvalidRequestError(f"give one output constraint, got {names}", param=names)
        if not found:
            return None
        params = found[0]
        params.whitespace_pattern = params.whitespace_pattern or self.guided_whitespace_pattern
        return params

    def _constraints(self) -> list[StructuredOutputsParams | None]:
        rf, so = self.response_format, self.structured_outputs
        out: list[StructuredOutputsParams | None] = [
            _from_response_format(rf) if rf is not None else None,
            None if so is None else StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object), whitespace_pattern=so.whitespace_pattern,
                disable_any_whitespace=so.disable_any_whitespace, param="structured_outputs",
            ),
        ]  # fmt: skip
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                kind = name.removeprefix("guided_")
                out.append(StructuredOutputsParams(**{kind: value}, param=name))
        return out


def _from_response_format(rf: ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    js = rf.json_schema
    if js is None or js.schema_ is None:
        raise InvalidRequestError(
            "response_format json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    return StructuredOutputsParams(json=js.schema_, param="response_format.json_schema.schema")
