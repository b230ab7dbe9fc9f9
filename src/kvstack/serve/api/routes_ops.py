"""Operations routes: ``GET /health`` (and vLLM's ``GET|POST /ping``, the SageMaker
probe), ``/load``, ``/version``, ``/metrics`` and the token tools ``POST /tokenize`` /
``/detokenize``.

``/health`` and ``/version`` never need the API key (probes carry none); with
``--api-key``, ``/tokenize``, ``/detokenize`` and ``/load`` need it and ``/metrics`` and
``/openapi.json`` do not, unless ``--open-endpoints`` says otherwise (SECURITY.md).
Tokenizing and templating run in ``ServerContext.off_loop``'s threads, never on the
event loop. ``/load`` is what a router polls: load and KV usage from the engine's latest
stats snapshot, plus the block-hash parameters (``AsyncEngine.routing_info``) it must
hash prompts with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvstack
from kvstack.serve.api.context import ServerContext
from kvstack.serve.api.http_errors import ApiError
from kvstack.serve.api.openapi import request_body
from kvstack.serve.api.protocol import DetokenizeRequest, TokenizeRequest


def ops_router(ctx: ServerContext, app_openapi: Callable[[], dict[str, Any]]) -> APIRouter:
    """The ops routes; ``app_openapi`` builds the app's OpenAPI document."""
    r = APIRouter()
    engine = ctx.engine

    @r.get("/health")
    @r.get("/ping")
    @r.post("/ping")
    async def health() -> Response:
        if not engine.alive:
            raise ApiError(503, "engine loop is not running", "server_error")
        return Response(status_code=200)

    @r.get("/load")
    async def load(raw: Request) -> dict:
        """What a router needs: load, KV usage, and the prefix-hash parameters."""
        ctx.check_ops_auth(raw, "load")
        s, routing = engine.stats, engine.routing_info
        return {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "kv_cache_usage_perc": s.kv_usage,
            "block_size": routing.block_size,
            "model_id": routing.model_id,
            "role": ctx.config.role,
            "served_model_name": ctx.config.model_name,
            "server_load": engine.num_active,  # vLLM's field: requests in flight
        }

    @r.get("/version")
    async def version() -> dict:
        return {"version": kvstack.__version__}

    @r.get("/metrics")
    async def prom(raw: Request) -> Response:
        ctx.check_ops_auth(raw, "metrics")
        metrics = engine.metrics
        data = generate_latest(metrics.registry) if metrics is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @r.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(raw: Request) -> dict:
        ctx.check_ops_auth(raw, "tokenize")
        req = await ctx.parse(raw, TokenizeRequest)
        ctx.check_model(req.model)
        ids = await ctx.off_loop(
            lambda: ctx.ids_of(
                req.prompt, req.messages, req.add_generation_prompt, req.add_special_tokens,
                req.continue_final_message, req.chat_template_kwargs, tools=req,
            )
        )  # fmt: skip
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.model_info.max_model_len}
        if req.return_token_strs:  # vLLM: each id's token as the vocabulary spells it
            out["token_strs"] = [ctx.tokenizer.id_to_piece(i) for i in ids]
        return out

    @r.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> dict:
        ctx.check_ops_auth(raw, "detokenize")
        req = await ctx.parse(raw, DetokenizeRequest)
        ctx.check_model(req.model)
        vocab = engine.model_info.vocab_size

        def decode() -> str:  # a million ids are seconds of CPU: checked off the loop too
            if any(t < 0 or t >= vocab for t in req.tokens):
                raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
            return ctx.tokenizer.decode(req.tokens, skip_special_tokens=False)

        return {"prompt": await ctx.off_loop(decode)}

    if ctx.config.frontend.disable_fastapi_docs:  # vLLM's --disable-fastapi-docs
        return r

    @r.get("/openapi.json", include_in_schema=False)
    async def openapi(raw: Request) -> JSONResponse:
        ctx.check_ops_auth(raw, "openapi")
        return JSONResponse(app_openapi())

    return r
