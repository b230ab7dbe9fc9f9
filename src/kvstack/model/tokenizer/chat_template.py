"""Chat templates: validate OpenAI-style messages and render them in a Jinja2 sandbox.

The environment matches the one transformers renders chat templates in, so prompts are
byte-for-byte the same: ``ImmutableSandboxedEnvironment`` (templates are untrusted code),
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that does not HTML-escape, and the ``raise_exception`` / ``strftime_now`` helpers. Template
errors (including ``raise_exception`` calls and sandbox violations) become
``InvalidRequestError``.

Every path that renders a chat (``LLM.chat``, the server's chat completions, ``/tokenize``
and ``/v1/cache/pin`` with messages, the router) goes through ``validate_messages``, so a
conversation becomes the same tokens everywhere: OpenAI's ``developer`` role is rendered
as ``system`` (``template_role``) and text content parts are joined with newlines
(``join_text_parts``, as vLLM does). ``continue_final_message`` leaves the final
(assistant) message open for the model to continue, cut as transformers cuts it.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvstack.core.errors import ConfigError, InvalidRequestError, ModelLoadError

_JINJA_CHARS = "{}\n"


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


def template_role(role: str) -> str:
    """The role a template sees: OpenAI's ``developer`` is a ``system`` message."""
    return "system" if role == "developer" else role


def join_text_parts(texts: list[str]) -> str:
    """The content of a message sent as text parts: the parts' texts, one per line."""
    return "\n".join(texts)


def load_chat_template(value: str) -> str:
    """``--chat-template`` (vLLM's rule): a file's text, or else the value itself as an
    inline template (its backslash escapes, such as ``\\n``, decoded); a value that looks
    like a path (none of ``{``, ``}``, newline) but cannot be read is a ``ConfigError``.
    The template must compile."""
    try:
        with open(Path(value).expanduser(), encoding="utf-8") as f:
            source = f.read()
    except (OSError, ValueError) as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ConfigError(
                f"--chat-template {value!r} looks like a path but cannot be read: {e}"
            ) from e
        source = codecs.decode(value, "unicode_escape") if value.isascii() else value
    try:
        compile_chat_template(source)
    except ModelLoadError as e:
        raise ConfigError(f"--chat-template does not compile: {e.__cause__}") from None
    return source


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and return plain-dict copies for the template.

    Each message needs a string ``role`` and a string ``content``. OpenAI-style content lists
    of ``{"type": "text", "text": ...}`` parts are joined with ``join_text_parts``;
    ``content`` may be None only on an assistant message carrying ``tool_calls``; the
    role is mapped with ``template_role``.
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
            content = join_text_parts(parts)
        elif not isinstance(content, str) and not (
            content is None and role == "assistant" and msg.get("tool_calls")
        ):  # None content is allowed only on an assistant message carrying tool calls
            raise InvalidRequestError(
                f"messages[{i}].content must be a string, got {type(content).__name__}"
            )
        out.append({**msg, "role": template_role(role), "content": content})
    return out


def render_chat_template(
    source: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Validate ``messages`` and render them with the template ``source``.

    ``variables`` (e.g. ``bos_token``, ``eos_token``, template switches) are visible to the
    template, as transformers passes its special tokens and extra keyword arguments.
    ``continue_final_message`` (vLLM / transformers) needs a final assistant message and
    ``add_generation_prompt=False``; the text ends where that message's content does.
    """
    chat = validate_messages(messages)
    if continue_final_message:
        _check_continuable(chat, add_generation_prompt)
    template = compile_chat_template(source)
    try:
        text = template.render(
            **variables,
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as e:
        raise InvalidRequestError(f"chat template rejected the messages: {e}") from e
    return _cut_after_final(text, chat[-1]["content"]) if continue_final_message else text


def _check_continuable(chat: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    param = "continue_final_message"
    if add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true: set "
            "add_generation_prompt to false to continue the final message",
            param=param,
        )
    if chat[-1]["role"] != "assistant" or not isinstance(chat[-1]["content"], str):
        raise InvalidRequestError(
            "continue_final_message needs the last message to be an assistant message "
            f"with text content, got a {chat[-1]['role']} message",
            param=param,
        )


def _cut_after_final(text: str, final: str) -> str:
    """``text`` up to the end of the final message's content (transformers' rule: the
    last occurrence of the stripped content; keep its trailing spaces if the template
    kept them)."""
    core = final.strip()
    if not core or core not in text:
        raise InvalidRequestError(
            "continue_final_message: the final message does not appear in the rendered chat "
            "(the template drops or rewrites it)",
            param="continue_final_message",
        )
    at = text.rindex(core)
    end = at + len(final.lstrip())
    return text[:end] if text[at:end] == final else text[: at + len(core)]
