"""The OpenAI-compatible HTTP server (FastAPI), as vLLM's ``api_server`` shapes it.

``create_app`` assembles one router per concept over a shared ``ServerContext``:

* ``routes_openai``: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``;
* ``routes_responses``: ``/v1/responses`` (OpenAI's Responses API) and its stored responses;
* ``routes_cache``: ``/v1/cache/pin`` / ``unpin``, ``/reset_prefix_cache``, ``/v1/kv_events``;
* ``routes_ops``: ``/health``, ``/load``, ``/version``, ``/metrics``, ``/tokenize``,
  ``/detokenize``, ``/openapi.json`` (``docs_pages``: ``/docs`` and ``/redoc``, assets local);
* ``routes_ui``: the web view at ``/`` (``/static/*``) and its ``/v1/kv/state`` stream.

Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with the
right status: 400 bad input, 401 wrong API key, 404 unknown model or route, 408 request
timeout, 413 body too large, 429 waiting queue full (with ``Retry-After``), 503 engine
down. Bodies are read and parsed (``ServerContext.parse``: size limit, UTF-8, JSON,
nesting) before pydantic validates them, so no malformed input reaches the engine; fields
no model declares are ignored and named in the ``kvstack-ignored-fields`` header
(``serve/api/leniency.py``). ``/openapi.json`` documents every request body
(``serve/api/openapi.py``). The routes reach the engine only through ``AsyncEngine``'s
public methods.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import kvstack
from kvstack.serve.api.context import ServerConfig, ServerContext
from kvstack.serve.api.docs_pages import docs_router
from kvstack.serve.api.http_errors import install_error_handlers
from kvstack.serve.api.leniency import IgnoredFieldsHeader
from kvstack.serve.api.openapi import publish_models
from kvstack.serve.api.protocol import REQUEST_MODELS
from kvstack.serve.api.routes_cache import cache_router
from kvstack.serve.api.routes_openai import OpenAIRoutes
from kvstack.serve.api.routes_ops import ops_router
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.responses.api import ResponsesHandler
from kvstack.serve.responses.protocol import ResponsesRequest
from kvstack.serve.responses.routes import responses_router
from kvstack.serve.ui.kv_state_stream import KVStateStream
from kvstack.serve.ui.routes import mount_ui

__all__ = ["ServerConfig", "create_app"]

logger = logging.getLogger("kvstack.serve")


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The server app for ``engine``; its lifespan starts the engine loop if it is not
    running and, on shutdown, lets in-flight requests finish for ``shutdown_grace_s``."""
    ctx = ServerContext(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.alive:
            engine.start()
        logger.info("serving %s", config.model_name)
        yield
        logger.info("shutting down: finishing %d in-flight requests", engine.num_active)
        await engine.shutdown(config.shutdown_grace_s)
        ctx.close()

    # /openapi.json is served by routes_ops (it may need the key: --open-endpoints).
    app = FastAPI(
        title="kvstack", version=kvstack.__version__, lifespan=lifespan,
        openapi_url=None, docs_url=None, redoc_url=None,
    )  # fmt: skip
    install_error_handlers(app, logger, ctx.count_error, ctx.count_internal)
    openai_routes = OpenAIRoutes(ctx)
    app.include_router(openai_routes.router())
    app.state.responses = ResponsesHandler(openai_routes)  # tests read its store
    app.include_router(responses_router(app.state.responses))
    app.include_router(ops_router(ctx, lambda: app.openapi()))
    app.include_router(cache_router(ctx))
    if not config.frontend.disable_fastapi_docs:  # vLLM's --disable-fastapi-docs
        app.include_router(docs_router(ctx, "kvstack"))
    app.state.kv_state = KVStateStream(engine)  # the web view's stream (tests read its counter)
    mount_ui(app, ctx, app.state.kv_state)
    app.add_middleware(IgnoredFieldsHeader)
    if config.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        f = config.frontend  # vLLM's --allowed-methods, --allowed-headers, --allow-credentials
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins),
            allow_methods=list(f.allowed_methods), allow_headers=list(f.allowed_headers),
            allow_credentials=f.allow_credentials,
        )  # fmt: skip
    publish_models(app, (*REQUEST_MODELS, ResponsesRequest))
    return app
