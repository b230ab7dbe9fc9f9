"""The Responses API routes (``responses_api.py``): ``POST /v1/responses``,
``GET`` / ``DELETE /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``, all behind
the API key like the other ``/v1`` routes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvstack.serve.api.openapi import request_body
from kvstack.serve.responses.api import ResponsesHandler
from kvstack.serve.responses.protocol import ResponsesRequest


def responses_router(handler: ResponsesHandler) -> APIRouter:
    r = APIRouter()
    ctx = handler.ctx

    @r.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def create(raw: Request) -> Response:
        ctx.check_auth(raw)
        return await handler.create(raw, await ctx.parse(raw, ResponsesRequest))

    @r.get("/v1/responses/{response_id}")
    async def get(raw: Request, response_id: str) -> dict[str, Any]:
        ctx.check_auth(raw)
        return handler.get(response_id)

    @r.delete("/v1/responses/{response_id}")
    async def delete(raw: Request, response_id: str) -> dict[str, Any]:
        ctx.check_auth(raw)
        return await handler.delete(response_id)

    @r.post("/v1/responses/{response_id}/cancel")
    async def cancel(raw: Request, response_id: str) -> dict[str, Any]:
        ctx.check_auth(raw)
        handler.cancel(response_id)  # raises: 404 unknown, 400 finished (no background)

    return r
