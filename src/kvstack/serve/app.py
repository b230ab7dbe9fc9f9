"""The OpenAI-compatible HTTP server (FastAPI), as vLLM's ``api_server`` shapes it.

Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with the
right status: 400 bad input, 401 wrong API key, 404 unknown model or route, 408 request
timeout, 413 body too large, 429 waiting queue full (with ``Retry-After``), 503 engine
down. Bodies are read and parsed here (size limit, UTF-8, JSON, nesting) before pydantic
validates them, so no malformed input reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import kvstack
from kvstack.errors import InvalidRequestError
from kvstack.request import SamplingParams
from kvstack.serve.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestInfo,
    RequestTimeoutError,
)
from kvstack.serve.http_errors import ApiError, check_bearer, install_error_handlers, read_body
from kvstack.serve.kv_events_stream import KVEventBroadcaster
from kvstack.serve.openai_api import ApiContext, OpenAIHandler
from kvstack.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    PinRequest,
    TokenizeRequest,
)

logger = logging.getLogger("kvstack.serve")
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float | None = None
    shutdown_grace_s: float = 30.0
    # Prefill/decode split (``--role``): a prefill replica computes the prompt's KV, waits
    # until its offload tiers hold it, and answers one token; "both" is a plain server.
    role: str = "both"
    prefill_flush_timeout_s: float = 30.0


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    tokenizer = engine.engine.tokenizer
    ctx = ApiContext(engine, tokenizer, config.model_name, config.request_timeout_s)
    handler = OpenAIHandler(ctx)
    metrics = engine.metrics
    kv_events = KVEventBroadcaster(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        logger.info("serving %s", config.model_name)
        yield
        logger.info("shutting down: finishing %d in-flight requests", engine.num_active)
        await engine.shutdown(config.shutdown_grace_s)

    app = FastAPI(title="kvstack", version=kvstack.__version__, lifespan=lifespan)

    def count_error(status: int) -> None:
        if metrics is not None:
            metrics.http_errors.labels(str(status)).inc()

    install_error_handlers(app, logger, count_error)

    def check_auth(raw: Request) -> None:
        check_bearer(raw, config.api_key)

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise ApiError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    async def parse(raw: Request, model: type[M]) -> M:
        body = await read_body(raw, config.max_body_bytes)
        try:
            data = json.loads(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise ApiError(400, "request body is not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise ApiError(400, f"malformed JSON: {e.msg} at position {e.pos}") from None
        except RecursionError:
            raise ApiError(400, "JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise ApiError(400, f"{param}: {first['msg']}", param=param) from None
        except RecursionError:
            raise ApiError(400, "JSON nested too deeply") from None

    async def serve_openai(raw: Request, req: Any, chat: bool) -> Response:
        check_model(req.model)
        if config.role == "prefill":  # the router sends the full request to a decode replica
            req.max_tokens, req.max_completion_tokens = 1, None
        try:
            if chat:
                msgs = req.template_messages()
                ids = tokenizer.apply_chat_template(
                    msgs, add_generation_prompt=req.add_generation_prompt, tokenize=True,
                    **(req.chat_template_kwargs or {}),
                )  # fmt: skip
                assert isinstance(ids, list)
                prompts: list[tuple[list[int], str | None]] = [(ids, None)]
            else:
                prompts = []
                for p in req.prompts():
                    if isinstance(p, str):
                        prompts.append((tokenizer.encode(p), p))
                    else:
                        prompts.append((list(p), None))
            session = raw.headers.get("x-session-id") or req.user
            rid, jobs = await handler.start(
                prompts, req, "chat" if chat else "completions", session
            )
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error") from None
        if req.stream:
            return StreamingResponse(
                handler.stream(rid, req, jobs, chat), media_type="text/event-stream"
            )
        task = asyncio.create_task(handler.complete(rid, jobs))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
            task.result()
        except RequestTimeoutError as e:
            raise ApiError(408, str(e), "timeout") from None
        finally:
            for job in jobs:
                job.stream.close()
        errors = [j.last.error for j in jobs if j.last is not None and j.last.error]
        if errors:
            raise ApiError(500, errors[0], "server_error")
        if config.role == "prefill":
            await flush_offload()
        body = (
            handler.chat_body(rid, req, jobs) if chat else handler.completion_body(rid, req, jobs)
        )
        return JSONResponse(body)

    async def flush_offload() -> None:
        """Prefill role: answer once the prompt's blocks are in the shared tier.

        The step that finished the request queued its blocks for storing before the
        output was delivered, so waiting for the store queue to drain is enough.
        """
        conn = engine.engine.connector
        if conn is None:
            return
        wait = config.prefill_flush_timeout_s
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, conn.offload.flush, wait):
            logger.warning("prefill: KV stores still queued after %.0fs", wait)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        check_auth(raw)
        return await serve_openai(raw, await parse(raw, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        check_auth(raw)
        return await serve_openai(raw, await parse(raw, ChatCompletionRequest), chat=True)

    @app.get("/v1/models")
    async def models(raw: Request) -> dict:
        check_auth(raw)
        card = {
            "id": config.model_name, "object": "model", "created": 0, "owned_by": "kvstack",
            "root": engine.engine.config.model, "max_model_len": engine.engine.max_model_len,
        }  # fmt: skip
        return {"object": "list", "data": [card]}

    def ids_of(
        prompt: str | list[int] | None,
        messages: list[ChatMessage] | None,
        add_generation_prompt: bool,
        add_special_tokens: bool,
    ) -> list[int]:
        """Token ids of exactly one of ``prompt`` (text or ids) or ``messages`` (templated)."""
        if (prompt is None) == (messages is None):
            raise ApiError(400, "give exactly one of prompt or messages")
        try:
            if messages is not None:
                msgs = [{"role": m.role, "content": m.text()} for m in messages]
                ids = tokenizer.apply_chat_template(
                    msgs, add_generation_prompt=add_generation_prompt, tokenize=True
                )
            elif isinstance(prompt, str):
                ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            else:
                ids = list(prompt or [])
        except InvalidRequestError as e:
            raise ApiError(400, str(e)) from None
        assert isinstance(ids, list)
        return ids

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        req = await parse(raw, TokenizeRequest)
        check_model(req.model)
        ids = ids_of(req.prompt, req.messages, req.add_generation_prompt, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        req = await parse(raw, DetokenizeRequest)
        check_model(req.model)
        vocab = engine.engine.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            raise ApiError(503, "engine loop is not running", "server_error")
        return Response(status_code=200)

    @app.get("/load")
    async def load() -> dict:
        """What a router needs: load, KV usage, and the prefix-hash parameters."""
        s = engine.stats
        kv = engine.engine.kv_manager
        return {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "kv_cache_usage_perc": s.kv_usage,
            "block_size": kv.block_size,
            "model_id": getattr(kv, "model_id", ""),  # the contiguous baseline has no hashes
            "role": config.role,
            "served_model_name": config.model_name,
        }

    @app.get("/v1/kv_events")
    async def kv_event_stream(raw: Request) -> Response:
        """KV events as Server-Sent Events: a snapshot, then every change (see
        ``serve/kv_events_stream.py`` for the format)."""
        check_auth(raw)
        if not engine.alive:
            raise ApiError(503, "engine loop is not running", "server_error")
        return StreamingResponse(kv_events.stream(), media_type="text/event-stream")

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvstack.__version__}

    @app.get("/metrics")
    async def prom() -> Response:
        data = generate_latest(metrics.registry) if metrics is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request) -> Response:
        check_auth(raw)
        await engine.run(engine.engine.reset_prefix_cache)
        return Response(status_code=200)

    async def pin_ids(raw: Request) -> tuple[list[int], PinRequest]:
        req = await parse(raw, PinRequest)
        check_model(req.model)
        ids = ids_of(req.prompt, req.messages, False, False)
        return ids, req

    @app.post("/v1/cache/pin")
    async def pin(raw: Request) -> dict:
        """Compute a prefix (system prompt, tool schema) if needed and pin its blocks."""
        check_auth(raw)
        ids, req = await pin_ids(raw)
        kv = engine.engine.kv_manager
        try:
            kv.check_pinnable(len(ids))
            stream = await engine.add(
                f"pin-{uuid.uuid4().hex}", ids, SamplingParams(max_tokens=1),
                RequestInfo("pin"), cache_salt=req.cache_salt,
            )  # fmt: skip
            await stream.final()
            pinned = await engine.run(lambda: engine.engine.pin_prefix(ids, req.cache_salt))
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        return {"pinned_tokens": pinned, "num_pinned_blocks": kv.num_pinned_blocks}

    @app.post("/v1/cache/unpin")
    async def unpin(raw: Request) -> dict:
        check_auth(raw)
        ids, req = await pin_ids(raw)
        done = await engine.run(lambda: engine.engine.unpin_prefix(ids, req.cache_salt))
        return {"unpinned": done}

    return app
