"""Tool calling for chat completions: prompt, constraint and parsed calls of one request.

``tool_choice`` decides what the model may do (OpenAI's semantics, vLLM's mechanics)::

    none        tools are shown in the prompt; the output is plain content
    auto        the output is parsed by --tool-call-parser (hermes by default): calls it
                finds become ``tool_calls``, finish_reason "tool_calls"; text that is not
                a valid call stays content (finish_reason "stop"), never an error
    required    the output is constrained (structured outputs) to calls of the tools, at
                least one (exactly one when parallel_tool_calls is false)
    {function}  the output is constrained to one call of that function

How a forced call is spelled depends on --tool-call-parser. With hermes (the default,
and the format the fallback prompt teaches) it is the prompt's own format: a Lark
grammar of ``<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>`` blocks whose JSON
is the tools' schemas (llguidance's ``%json``), parsed back by the hermes parser. With the
other parsers it is vLLM's (``ChatCompletionRequest._get_json_schema_from_tool`` in vLLM's
protocol.py): a JSON array of ``{"name", "parameters"}`` for required, the parameters
object for a named function. Either way even a 135M model emits calls that validate.
Deviations from vLLM: hermes calls follow the prompt's format rather than vLLM's array
(on SmolLM2-135M the array made it pick wrong tools and ramble in strings); the forced
JSON has no free whitespace (a small model cannot pad until ``max_tokens``); vLLM keeps
``finish_reason`` "stop" for a named tool_choice (as OpenAI does), kvstack answers
"tool_calls" whenever the message carries calls.

Prompt: a chat template that references ``tools`` gets them (and assistant tool calls
with their arguments parsed into objects, as vLLM's chat_utils does); a template without
a tool section (the default model's) gets the Hermes-style fallback of ``tool_prompt.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvstack.core.errors import InvalidRequestError
from kvstack.core.structured_outputs import StructuredOutputsParams, closed_objects
from kvstack.serve.api.protocol_tools import NamedToolChoice, ToolDef
from kvstack.serve.chat.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    make_tool_call_id,
)
from kvstack.serve.chat.tool_prompt import (
    fallback_messages,
    template_messages_with_tools,
    template_supports_tools,
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What one chat request's tools mean for its prompt, constraint and output."""

    tools: list[ToolDef]
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function of a named tool_choice
    parallel: bool = True
    parser_name: str = "hermes"
    names: set[str] = field(default_factory=set)

    @classmethod
    def build(
        cls,
        tools: list[ToolDef] | None,
        choice: str | NamedToolChoice | None,
        parallel: bool | None,
        parser_name: str,
        auto_enabled: bool = True,
    ) -> ToolPlan | None:
        """The plan of a request, None without tools; 400 naming the bad field."""
        if not tools:
            if choice is not None and choice != "none":
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return None
        names = [t.function.name for t in tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise InvalidRequestError(f"duplicate tool names: {', '.join(dup)}", param="tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )
            mode, name = "named", choice.function.name
        else:
            mode, name = (choice or "auto"), None
        if mode == "auto" and not auto_enabled:
            raise InvalidRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return cls(list(tools), mode, name, parallel is not False, parser_name, set(names))

    # ------------------------------------------------------------------ constraint
    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-outputs constraint of a forced choice (None: none/auto)."""
        if self.mode not in ("named", "required"):
            return None
        tools = [t for t in self.tools if self.mode == "required" or t.function.name == self.name]
        if self.parser_name == "hermes":
            return StructuredOutputsParams(grammar=self._hermes_grammar(tools), param="tools")
        if self.mode == "named":
            params = tools[0].function.parameters or EMPTY_PARAMETERS
            return StructuredOutputsParams(json=params, disable_any_whitespace=True, param="tools")
        items = [_call_schema(t, "parameters") for t in tools]
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": items},
            **_hoisted_defs(items),
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True, param="tools")

    def _hermes_grammar(self, tools: list[ToolDef]) -> str:
        """Lark: one or more ``<tool_call>`` blocks, each a call of one of ``tools``
        (llguidance's ``%json`` embeds the schema), spaced like the prompt's example."""
        calls = [closed_objects(_call_schema(t, "arguments")) for t in tools]
        body = json.dumps({"anyOf": calls, **_hoisted_defs(calls), "x-guidance": _SPACING})
        many = self.mode == "required" and self.parallel
        start = 'start: call ("\\n" call)*' if many else "start: call"
        return f'{start}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {body}\n'

    # ------------------------------------------------------------------ prompt
    def render(
        self, messages: list[dict[str, Any]], template: str
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages (and the template's ``tools`` argument) for the chat template."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if template_supports_tools(template):
            return template_messages_with_tools(messages), tools
        return fallback_messages(messages, tools, self.describe_choice()), None

    def describe_choice(self) -> str | None:
        if self.mode == "required":
            return "You must call at least one function."
        if self.mode == "named":
            return f"You must call the function {self.name}."
        return None

    # ------------------------------------------------------------------ output
    @property
    def parser(self) -> ToolParser:
        return TOOL_PARSERS.get(self.parser_name)()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. A forced choice (named, required) has
        content "" as vLLM's (``message_assembly``), its calls only if complete: an
        output cut by ``max_tokens`` gives no calls and no raw call text."""
        if self.mode == "none":
            return text, []
        if self.forced:
            if self.parser_name != "hermes":
                return "", self.forced_calls(text)
            return "", self.parser.extract(text, self.names).tool_calls
        parsed = self.parser.extract(text, self.names)
        return parsed.content, parsed.tool_calls

    @property
    def forced(self) -> bool:
        """tool_choice named or required: the output is constrained to calls."""
        return self.mode in ("named", "required")

    def streamer(self) -> ChoiceToolStream | None:
        """Streaming state of one choice (None: content streams as is)."""
        return None if self.mode == "none" else ChoiceToolStream(self)

    def forced_calls(self, text: str) -> list[ToolCall]:
        """The calls of a constrained output; [] if it is incomplete (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return []
        if self.mode == "named":
            if not isinstance(value, dict):
                return []
            return [ToolCall(make_tool_call_id(), str(self.name), _dumps(value))]
        if not isinstance(value, list):
            return []
        calls = []
        for item in value:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return []
            args = _dumps(item.get("parameters", {}))
            calls.append(ToolCall(make_tool_call_id(), item["name"], args))
        return calls


# JSON spacing of forced hermes calls: that of the prompt's example, no other whitespace.
_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _hoisted_defs(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``$defs`` / ``definitions`` of the tools' parameters, moved (in place) to the
    root of the schema that nests them, so ``#/$defs/..`` references still resolve (vLLM's
    ``get_tool_schema_defs``). Two tools defining one name differently: 400."""
    roots: dict[str, dict[str, Any]] = {}
    for call in calls:
        params = next(v for k, v in call["properties"].items() if k != "name")
        if not isinstance(params, dict):
            continue
        for key in ("$defs", "definitions"):
            defs = params.pop(key, None)
            if not isinstance(defs, dict):
                continue
            root = roots.setdefault(key, {})
            for name, sub in defs.items():
                if name in root and root[name] != sub:
                    raise InvalidRequestError(
                        f"tools define {key}/{name} differently", param="tools"
                    )
                root[name] = sub
    return roots


def _call_schema(tool: ToolDef, key: str) -> dict[str, Any]:
    """``{"name": <the tool>, key: <its parameters>}`` (vLLM's, with key "parameters")."""
    fn = tool.function
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [fn.name]},
            key: dict(fn.parameters or EMPTY_PARAMETERS),  # a copy: $defs move out of it
        },
        "required": ["name", key],
    }


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class ChoiceToolStream:
    """One streamed choice of a tool request: content deltas and ``tool_calls`` deltas.

    ``auto`` and forced hermes calls run the parser's ``ToolStreamer`` (content flows
    until a call may begin; each call is sent once complete); a forced JSON choice (other
    parsers) holds its JSON and sends the calls when the output ends (or the text, as
    content, when it was cut short).
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        parsed = plan.mode == "auto" or plan.parser_name == "hermes"  # forced hermes too
        self.auto = ToolStreamer(plan.parser, plan.names) if parsed else None
        self.text = ""
        self.num_calls = 0

    def delta(self, text: str, done: bool) -> dict[str, Any]:
        """The chat ``delta`` for new text (and the end of the output when ``done``)."""
        events = self.feed(text) + (self.finish() if done else [])
        if self.plan.forced:  # calls only (vLLM): no text of a call cut by max_tokens
            events = [e for e in events if not isinstance(e, ContentDelta)]
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls: dict[int, dict[str, Any]] = {}
        for e in events:
            if isinstance(e, ToolCallDelta):
                entry = e.to_openai()
                if e.index in calls:  # header and arguments of one call: one entry
                    calls[e.index]["function"]["arguments"] += e.arguments
                else:
                    calls[e.index] = entry
        out: dict[str, Any] = {"content": content} if content or not calls else {}
        if calls:
            out["tool_calls"] = list(calls.values())
        return out

    def feed(self, delta: str) -> list[StreamEvent]:
        self.text += delta
        return self.auto.feed(delta) if self.auto is not None else []

    def finish(self) -> list[StreamEvent]:
        if self.auto is not None:
            events = self.auto.finish()
            self.num_calls = self.auto.tool_calls_sent
            return events
        calls = self.plan.forced_calls(self.text)
        self.num_calls = len(calls)
        if not calls:
            return [ContentDelta(self.text)] if self.text else []
        return [ToolCallDelta(i, c.arguments, id=c.id, name=c.name) for i, c in enumerate(calls)]
