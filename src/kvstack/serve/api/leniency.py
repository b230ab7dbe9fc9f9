"""Unknown request fields: accepted, ignored and reported, as vLLM does.

``ServerContext.parse`` validates a body, finds the fields no request model declares
(``chat/messages.ignored_fields``), logs one warning naming them and records them on the
request (``note_ignored``); ``IgnoredFieldsHeader``, an ASGI middleware, then answers
them in the ``kvstack-ignored-fields`` response header (comma-separated dotted paths,
e.g. ``messages.0.foo,stream_options.bar``), on streamed and error responses too.

Field names are client text: in the header each is percent-encoded (``.`` kept), and
the header and the log line stop after a bounded number of names, so neither a comma, a
newline nor an 8 MiB key reaches a header or a log unescaped.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

IGNORED_FIELDS_HEADER = "kvstack-ignored-fields"
MAX_HEADER_CHARS = 2048
MAX_LOGGED = 20
_STATE_KEY = "kvstack_ignored_fields"  # in the request's scope["state"] (Request.state)

logger = logging.getLogger("kvstack.serve")


def header_value(fields: list[str]) -> str:
    """The header's value: the encoded paths, comma-separated, at most ``MAX_HEADER_CHARS``."""
    out: list[str] = []
    size = 0
    for name in fields:
        enc = quote(name, safe="._-~")
        if size + len(enc) + 1 > MAX_HEADER_CHARS:
            break
        out.append(enc)
        size += len(enc) + 1
    return ",".join(out)


def note_ignored(raw: Request, fields: list[str]) -> None:
    """Log the ignored ``fields`` of ``raw`` and have its response name them."""
    if not fields:
        return
    shown = ", ".join(repr(f[:80]) for f in fields[:MAX_LOGGED])
    more = f" (and {len(fields) - MAX_LOGGED} more)" if len(fields) > MAX_LOGGED else ""
    logger.warning("%s %s: ignoring unknown fields %s%s", raw.method, raw.url.path, shown, more)
    raw.state.kvstack_ignored_fields = header_value(fields)


class IgnoredFieldsHeader:
    """ASGI middleware: adds ``kvstack-ignored-fields`` to a response whose request body
    had fields the server ignored (recorded by ``note_ignored``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state: dict[str, Any] = scope.setdefault("state", {})

        async def send_with_header(message: Message) -> None:
            value = state.get(_STATE_KEY)
            if message["type"] == "http.response.start" and value:
                headers = [
                    *message.get("headers", []),
                    (IGNORED_FIELDS_HEADER.encode(), value.encode()),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)
