"""Chat templates: validate OpenAI-style messages and render them in a Jinja2 sandbox.

The environment matches the one transformers renders chat templates in, so prompts are
byte-for-byte the same: ``ImmutableSandboxedEnvironment`` (templates are untrusted code),
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that does not HTML-escape, and the ``raise_exception`` / ``strftime_now`` helpers. Template
errors (including ``raise_exception`` calls and sandbox violations) become
``InvalidRequestError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvstack.errors import InvalidRequestError, ModelLoadError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured like transformers' renderer."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template does not compile: {e}") from e


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return plain-dict copies for the template.

    Each message needs a string ``role`` and a string ``content``. OpenAI-style content lists
    of ``{"type": "text", "text": ...}`` parts are joined with newlines; ``content`` may be
    None only on an assistant message carrying ``tool_calls``.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}] has no string 'role'")
        if "content" not in msg:
            raise InvalidRequestError(f"messages[{i}] ({role}) has no 'content'")
        content = msg["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (
                    isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise InvalidRequestError(
                        f"messages[{i}].content: only text parts are supported, got {part!r:.80}"
                    )
                parts.append(part["text"])
            content = "\n".join(parts)
        elif not isinstance(content, str) and not (
            content is None and role == "assistant" and msg.get("tool_calls")
        ):  # None content is allowed only on an assistant message carrying tool calls
            raise InvalidRequestError(
                f"messages[{i}].content must be a string, got {type(content).__name__}"
            )
        out.append({**msg, "content": content})
    return out


def render_chat_template(
    source: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Validate ``messages`` and render them with the template ``source``.

    ``variables`` (e.g. ``bos_token``, ``eos_token``, template switches) are visible to the
    template, as transformers passes its special tokens and extra keyword arguments.
    """
    chat = validate_messages(messages)
    template = compile_chat_template(source)
    try:
        return template.render(
            **variables,
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"chat template rejected the messages: {e}") from e
