"""OpenAI-style HTTP errors, bearer auth and bounded bodies: shared by ``kvstack serve``
(``serve/api/app.py``) and ``kvstack router`` (``route/router/app.py``).

Every error leaves as ``{"error": {"message", "type", "param", "code"}}`` with its
status; a route raises ``ApiError`` and never builds a response by hand. Light on
imports (no engine, no torch) so the router loads fast.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvstack.serve.api.protocol import error_body

# vLLM's error ``type`` per status (its ``create_error_response``: ``BadRequestError`` by
# default, ``NotFoundError`` for an unknown model, ``InternalServerError``); a status vLLM
# never answers by itself keeps OpenAI's ``invalid_request_error``.
VLLM_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


class ApiError(Exception):
    """An error answered as ``{"error": {...}}`` with ``status``; ``type_`` defaults to
    vLLM's type for the status (``VLLM_ERROR_TYPES``)."""

    def __init__(
        self, status: int, message: str, type_: str | None = None,
        param: str | None = None, code: Any = None, headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        kind = type_ or VLLM_ERROR_TYPES.get(status, "invalid_request_error")
        self.status, self.message, self.type, self.param = status, message, kind, param
        self.code = code if code is not None else status
        self.headers = headers


def install_error_handlers(
    app: FastAPI,
    logger: logging.Logger,
    on_error: Callable[[int], None] | None = None,
    on_internal: Callable[[], None] | None = None,
) -> Callable[[ApiError], JSONResponse]:
    """Answer ``ApiError``, Starlette's HTTP errors (404, 405...), a client that left
    mid-body (499) and any other exception (500, logged with its traceback) as OpenAI
    errors; ``on_error(status)`` counts them and ``on_internal()`` the unexpected
    exceptions. An internal error stays a 500: no catch-all turns one into a 400.
    Returns the function that turns an ``ApiError`` into its response."""

    def err(e: ApiError) -> JSONResponse:
        if on_error is not None:
            on_error(e.status)
        return JSONResponse(
            error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers
        )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return err(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # vLLM answers Starlette's errors (no such route, wrong method) with the status
        # phrase as the type: "Not Found", "Method Not Allowed".
        return err(ApiError(e.status_code, str(e.detail), HTTPStatus(e.status_code).phrase))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(raw: Request, _: ClientDisconnect) -> JSONResponse:
        # The client closed the connection before its body arrived (Content-Length 1000,
        # 10 bytes, close): its doing, not a bug, so no traceback and no internal error.
        # 499 (nginx's "client closed request") is counted; nobody reads the answer.
        logger.info("client closed %s %s before its body arrived", raw.method, raw.url.path)
        return err(ApiError(499, "client closed the request", code="client_closed_request"))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        if on_internal is not None:
            on_internal()
        return err(ApiError(500, f"internal error: {e}"))

    return err


def check_bearer(raw: Request, api_key: str | None) -> None:
    """401 unless ``Authorization: Bearer <api_key>`` (constant-time); no key = open."""
    if api_key is None:
        return
    got = raw.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
        raise ApiError(401, "invalid or missing API key", code="invalid_api_key")


async def read_body(raw: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, 413 as soon as it passes ``limit`` bytes (declared or streamed),
    408 if it has not all arrived within ``timeout_s`` (a client that declares 100 bytes
    and sends 10 held the handler forever: a slowloris body)."""
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body over {limit} bytes")
    body = bytearray()

    async def read() -> None:
        async for chunk in raw.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, f"request body over {limit} bytes")

    try:
        async with asyncio.timeout(timeout_s):
            await read()
    except TimeoutError:
        raise ApiError(408, f"request body not received within {timeout_s} s", "timeout") from None
    return bytes(body)
