"""Prefix-cache routes: ``POST /v1/cache/pin`` / ``/v1/cache/unpin``,
``POST /reset_prefix_cache`` and the KV event stream ``GET /v1/kv_events``.

All need the API key. Pinning, unpinning and resetting run on the engine thread
(``AsyncEngine.pin_prefix`` etc.), so the HTTP thread never reads the KV manager; a
prefix that can never be pinned (shorter than a block, over the pin budget, no prefix
cache) is a 400 before anything is computed.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvstack.core.errors import InvalidRequestError
from kvstack.serve.api.context import ServerContext
from kvstack.serve.api.http_errors import ApiError
from kvstack.serve.api.openapi import request_body
from kvstack.serve.api.protocol import PinRequest
from kvstack.serve.events.stream import KVEventBroadcaster


def cache_router(ctx: ServerContext) -> APIRouter:
    r = APIRouter()
    engine = ctx.engine
    kv_events = KVEventBroadcaster(engine)

    async def pin_ids(raw: Request) -> tuple[list[int], PinRequest]:
        req = await ctx.parse(raw, PinRequest)
        ctx.check_model(req.model)
        vocab = engine.model_info.vocab_size
        if isinstance(req.prompt, list) and any(not 0 <= t < vocab for t in req.prompt):
            # Before hashing: an id past 64 bits was an OverflowError there, a 500.
            raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return await ctx.off_loop(lambda: ctx.ids_of(req.prompt, req.messages, False, False)), req

    @r.post("/v1/cache/pin", openapi_extra=request_body(PinRequest))
    async def pin(raw: Request) -> dict:
        """Compute a prefix (system prompt, tool schema) if needed and pin its blocks."""
        ctx.check_auth(raw)
        ids, req = await pin_ids(raw)
        try:
            done = await engine.pin_prefix(ids, req.cache_salt)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        return {"pinned_tokens": done.pinned_tokens, "num_pinned_blocks": done.num_pinned_blocks}

    @r.post("/v1/cache/unpin", openapi_extra=request_body(PinRequest))
    async def unpin(raw: Request) -> dict:
        ctx.check_auth(raw)
        ids, req = await pin_ids(raw)
        return {"unpinned": await engine.unpin_prefix(ids, req.cache_salt)}

    @r.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request) -> Response:
        ctx.check_auth(raw)
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @r.get("/v1/kv_events")
    async def kv_event_stream(raw: Request) -> Response:
        """KV events as Server-Sent Events: a snapshot, then every change (see
        ``serve/events/stream.py`` for the format)."""
        ctx.check_auth(raw)
        if not engine.alive:
            raise ApiError(503, "engine loop is not running", "server_error")
        stream = kv_events.open_stream()
        if stream is None:
            raise ApiError(
                429, f"{kv_events.max_connections} KV event streams are open already",
                "rate_limit_error", headers={"Retry-After": "5"},
            )  # fmt: skip
        return StreamingResponse(stream, media_type="text/event-stream")

    return r
