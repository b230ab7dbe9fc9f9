"""``Ingress``: the OpenAI front of the Ray deployment (tokenizes, calls the engine handle).

It answers ``GET /router/state`` from this process's routers, tokenizes OpenAI bodies so
the router can match prefixes, and retries a call once on another replica if the chosen
one dies before the first byte (Ray raises an actor error); once bytes are relayed there
is no retry, and a death mid-stream ends the stream with an error event.

As ``kvstack serve`` (the same fault defences): the body is read under ``--max-body-bytes``
and ``--body-timeout`` (413 / 408), tokenizing runs in a worker thread, not on the event
loop, and ``/router/state`` needs the API key when one is set.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvstack.route.policy.prompt import prompt_info
from kvstack.route.ray import state
from kvstack.route.ray.replica import EngineCall
from kvstack.serve.api.http_errors import ApiError, check_bearer, read_body
from kvstack.serve.api.protocol import error_body

logger = logging.getLogger("kvstack.route.ray")
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class IngressLimits:
    """The server options the ingress applies before a replica sees the request."""

    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float | None = 30.0


class Ingress:
    """The OpenAI front of the Ray deployment: tokenizes, then calls the engine handle."""

    def __init__(self, engine: Any, model: str, limits: IngressLimits | None = None) -> None:
        from kvstack.model.loader.registry import load_tokenizer

        self.tokenizer = load_tokenizer(model)
        self.engine = engine.options(stream=True)
        self.limits = limits or IngressLimits()

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._serve(request)
        except ApiError as e:
            err = error_body(e.message, e.type, e.param, e.code)
            return JSONResponse(err, status_code=e.status, headers=e.headers)

    async def _serve(self, request: Request) -> Response:
        path, lim = request.url.path, self.limits
        if path == "/router/state":
            check_bearer(request, lim.api_key)
            return JSONResponse([r.state() for r in state.ROUTERS])
        body = await read_body(request, lim.max_body_bytes, lim.body_timeout_s)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k in ("authorization", "content-type", "x-session-id")
        }
        call = EngineCall(request.method, path, body, headers)
        if request.method == "POST" and path in OPENAI_PATHS:
            info = await asyncio.to_thread(prompt_info, self.tokenizer, path, body)
            if info is not None:
                call = EngineCall(
                    request.method, path, body, headers, tuple(info.token_ids), info.cache_salt
                )
        for attempt in (0, 1):
            gen = self.engine.remote(call)
            try:
                head = await gen.__anext__()
            except RayActorError as e:  # died before the first byte: safe to retry once
                if attempt:
                    return _error(503, f"no replica could serve the request: {e}")
                logger.warning("replica died before answering; retrying once: %s", e)
                continue
            return StreamingResponse(
                _relay(gen), status_code=head["status"], media_type=head["content_type"] or None
            )
        raise AssertionError("unreachable")


async def _relay(gen: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in gen:
            yield chunk
    except RayActorError as e:  # died mid-stream: no retry, the client sees an error event
        err = error_body(f"replica died mid-stream: {e}", "server_error", None, 503)
        yield b"data: " + json.dumps(err).encode() + b"\n\n"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error", None, status), status_code=status)
