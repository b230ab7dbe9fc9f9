"""Tools in the prompt: the model's own template when it knows tools, else a fallback.

* ``template_supports_tools(source)``: the Jinja source reads a ``tools`` variable (as
  Qwen 2.5 / 3, Hermes 2 Pro, Llama 3.1+, Mistral templates do). The default model,
  SmolLM2, has a plain ChatML template without one.
* ``template_messages_with_tools(messages)``: for such templates, assistant
  ``tool_calls`` arguments parsed from JSON strings to dicts, as vLLM's
  ``_postprocess_messages`` (``vllm/entrypoints/chat_utils.py``) does before rendering:
  templates print them with ``tojson``. Empty or invalid arguments become ``{}`` (with a
  warning, so a bad turn in the history never fails every later request); an empty
  ``tool_calls`` list is dropped; an entry that is not a function call is a 400.
* ``fallback_messages(messages, tools, tool_choice_desc)``: for templates without tools,
  the conversation rewritten into plain ``system`` / ``user`` / ``assistant`` messages the
  way Qwen 2.5 / Qwen 3's templates render it (NousResearch Hermes 2 Pro's format), so any
  ChatML template shows the model the tools and its earlier calls and results, and the
  ``hermes`` parser reads its answer:

  - the tools section (``tools_system_prompt``) is appended to a first ``system``
    message after a blank line (Qwen 3), or becomes the first message;
  - an assistant message with ``tool_calls`` becomes its text, then one
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call, joined
    by newlines;
  - ``tool`` messages become one ``user`` message per run of consecutive ones, each
    result as ``<tool_response>\\n...\\n</tool_response>``, joined by newlines
    (``tool_call_id`` and ``name`` are not shown, as in Qwen's templates).

Messages are plain dicts ``{role, content, tool_calls?, tool_call_id?, name?}`` with string
(or, on an assistant message with calls, None) content; inputs are never modified.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta

from kvstack.core.errors import InvalidRequestError

logger = logging.getLogger("kvstack.serve")

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_TOOLS_WORD = re.compile(r"\btools\b")
_JINJA_BLOCK = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)


def template_supports_tools(template: str) -> bool:
    """True when the Jinja source reads a ``tools`` variable passed by the caller."""
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:  # not parseable here: look inside its tags instead
        return any(_TOOLS_WORD.search(b) for b in _JINJA_BLOCK.findall(template))


def tools_system_prompt(tools: list[dict[str, Any]], tool_choice_desc: str | None = None) -> str:
    """The tools section of the system message (Qwen 2.5's wording), one JSON per tool."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    text = TOOLS_HEADER + listed + TOOLS_FOOTER
    if tool_choice_desc:
        text += "\n\n" + tool_choice_desc
    return text


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments as a dict, by vLLM's ``_postprocess_messages`` rules."""
    raw = function.get("arguments")
    if not raw:
        return {}
    if isinstance(raw, dict):
        return raw
    parsed: Any = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            logger.warning(
                "tool call %r: arguments are not valid JSON (%d chars); using {}",
                function.get("name"),
                len(raw),
            )
            return {}
    if not isinstance(parsed, dict):
        logger.warning(
            "tool call %r: arguments are a JSON %s, not an object; using {}",
            function.get("name"),
            type(parsed).__name__,
        )
        return {}
    return parsed


def _normalized_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` copied with ``function.arguments`` as a dict."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where}.tool_calls must be a list", param="messages")
    out = []
    for j, item in enumerate(calls):
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or item.get("type", "function") != "function":
            raise InvalidRequestError(
                f"{where}.tool_calls[{j}] must be a function call "
                '{"type": "function", "function": {"name": ..., "arguments": ...}}',
                param="messages",
            )
        out.append({**item, "function": {**function, "arguments": _arguments(function)}})
    return out


def template_messages_with_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that supports tools: call arguments as dicts."""
    out = []
    for i, msg in enumerate(messages):
        if msg.get("role") == "assistant" and "tool_calls" in msg:
            msg = dict(msg)
            calls = msg.pop("tool_calls")
            if calls:
                msg["tool_calls"] = _normalized_calls(calls, f"messages[{i}]")
        out.append(dict(msg))
    return out


def _render_calls(content: str | None, calls: list[dict[str, Any]]) -> str:
    parts = [content] if content else []
    for call in calls:
        function = call["function"]
        parts.append(
            '<tool_call>\n{"name": '
            + json.dumps(function.get("name"), ensure_ascii=False)
            + ', "arguments": '
            + json.dumps(function["arguments"], ensure_ascii=False)
            + "}\n</tool_call>"
        )
    return "\n".join(parts)


def _tool_response(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    return "<tool_response>\n" + ("" if content is None else str(content)) + "\n</tool_response>"


def fallback_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    tool_choice_desc: str | None = None,
) -> list[dict[str, Any]]:
    """The conversation for a template without tools (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "tool":
            if i > 0 and messages[i - 1].get("role") == "tool":
                out[-1]["content"] += "\n" + _tool_response(msg)
            else:
                out.append({"role": "user", "content": _tool_response(msg)})
        elif role == "assistant" and msg.get("tool_calls"):
            calls = _normalized_calls(msg["tool_calls"], f"messages[{i}]")
            rest = {k: v for k, v in msg.items() if k != "tool_calls"}
            out.append({**rest, "content": _render_calls(msg.get("content"), calls)})
        else:
            rest = {k: v for k, v in msg.items() if k != "tool_calls"}
            if rest.get("content") is None:
                rest["content"] = ""
            out.append(rest)
    if tools:
        section = tools_system_prompt(tools, tool_choice_desc)
        if out and out[0].get("role") == "system":
            system = out[0].get("content") or ""
            out[0] = {**out[0], "content": system + "\n\n" + section if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
