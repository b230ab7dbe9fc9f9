"""The OpenAI routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

A request is checked (API key, body, model name), tokenized here (a completion's prompts
with ``tokenizer.encode`` or as given ids, a chat through the chat template), queued as
one engine request per prompt (``OpenAIHandler``) and answered as a stream or as one
body. Errors: 400 invalid input, 404 unknown model, 408 past ``--request-timeout``, 429
waiting queue full (``Retry-After: 1``), 499 client gone before the answer, 500 a failed
step, 503 engine down. A prefill replica (``--role prefill``) computes one token and
answers only once its offload tiers hold the prompt's blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstack.core.errors import InvalidRequestError
from kvstack.core.structured_outputs import SpecTooLargeError
from kvstack.serve.api.context import ServerContext
from kvstack.serve.api.http_errors import ApiError
from kvstack.serve.api.jobs import Job
from kvstack.serve.api.openai_api import ApiContext, OpenAIHandler
from kvstack.serve.api.openapi import request_body
from kvstack.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from kvstack.serve.api.vllm_checks import check_request, log_request, model_card
from kvstack.serve.async_engine import EngineDeadError, QueueFullError
from kvstack.serve.chat.segments import Mark
from kvstack.serve.output_stream import RequestTimeoutError

logger = logging.getLogger("kvstack.serve")
# (token ids, the text they came from, segment token ranges or None)
Prompts = list[tuple[list[int], str | None, list[Mark] | None]]
DONE = "data: [DONE]\n\n"  # the last event of every stream (openai_api.py)


class OpenAIRoutes:
    """The three routes over one ``OpenAIHandler``."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        api = ApiContext(
            ctx.engine, ctx.tokenizer, cfg.model_name, cfg.request_timeout_s,
            cfg.max_sequences_per_request, ctx.reasoning, cfg.frontend,
            cfg.frontend.fingerprint(cfg.identity),
        )  # fmt: skip
        self.handler = OpenAIHandler(api)

    def router(self) -> APIRouter:
        r = APIRouter()
        ctx = self.ctx

        @r.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
        async def completions(raw: Request) -> Response:
            ctx.check_auth(raw)
            return await self.serve(raw, await ctx.parse(raw, CompletionRequest))

        @r.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
        async def chat_completions(raw: Request) -> Response:
            ctx.check_auth(raw)
            return await self.serve(raw, await ctx.parse(raw, ChatCompletionRequest))

        @r.post("/invocations")
        async def invocations(raw: Request) -> Response:
            """SageMaker's entry point, as vLLM's: a chat body (``messages``) or a
            completion body (``prompt``), chosen by which one the body validates as.
            Unlike vLLM's, it needs the API key like ``/v1/*`` (it runs the same model)."""
            ctx.check_auth(raw)
            req = await ctx.parse_first(raw, (ChatCompletionRequest, CompletionRequest))
            assert isinstance(req, ChatCompletionRequest | CompletionRequest)
            return await self.serve(raw, req)

        @r.get("/v1/models")
        async def models(raw: Request) -> dict:
            ctx.check_auth(raw)
            info = ctx.engine.model_info
            names = (ctx.config.model_name, *ctx.config.model_aliases)
            cards = [model_card(n, info.root, info.max_model_len) for n in names]
            return {"object": "list", "data": cards}

        return r

    def prompts(self, req: CompletionRequest | ChatCompletionRequest) -> Prompts:
        """The request's prompts as token ids (``InvalidRequestError`` if untokenizable)."""
        tok = self.ctx.tokenizer
        if isinstance(req, ChatCompletionRequest):
            cfg = self.ctx.config
            req.tool_plan(cfg.tool_call_parser, cfg.enable_auto_tool_choice)
            auto = self.ctx.engine.segments_enabled and req.kv_press is None  # (presses drop KV)
            seg = req.segments(tok) if auto else None
            if seg is not None:  # tools, documents, marked parts: reusable segments
                return [(seg[0], None, seg[1])]
            return [(req.prompt_ids(tok), None, None)]
        return [
            (tok.encode(p), p, None) if isinstance(p, str) else (list(p), None, None)
            for p in req.prompts()
        ]

    async def start(
        self,
        raw: Request,
        req: CompletionRequest | ChatCompletionRequest,
        render: Callable[[], Prompts] | None = None,
        endpoint: str | None = None,
    ) -> tuple[str, list[Job]]:
        """Queue the request's prompts (``render``'s, if given: the Responses API renders
        its own); its errors as the ``ApiError`` of their status."""
        chat = isinstance(req, ChatCompletionRequest)
        opts = self.ctx.config.frontend
        try:
            check_request(req, opts)
            if isinstance(req, ChatCompletionRequest):
                req.use_response_role(opts.response_role)
                if kwargs := opts.template_defaults():  # the request's own keys win
                    req.chat_template_kwargs = {**kwargs, **(req.chat_template_kwargs or {})}
            defaults = self.ctx.engine.generation_defaults
            make_prompts = render or (lambda: self.prompts(req))
            # Both CPU work (a million stop_token_ids took 1.5 s to check): off the loop.
            prompts, sp = await self.ctx.off_loop(
                lambda: (make_prompts(), req.sampling_params(defaults))
            )
            session = raw.headers.get("x-session-id") or req.user
            rid, jobs = await self.handler.start(
                prompts, req, sp, endpoint or ("chat" if chat else "completions"), session
            )
            if opts.enable_log_requests:
                log_request(rid, req, [len(ids) for ids, _, _ in prompts])
            return rid, jobs
        except SpecTooLargeError as e:
            raise ApiError(413, str(e), param=e.param) from None
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_error", headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise ApiError(503, str(e), "server_error") from None

    async def serve(self, raw: Request, req: CompletionRequest | ChatCompletionRequest) -> Response:
        self.ctx.check_model(req.model)
        chat = isinstance(req, ChatCompletionRequest)
        if self.ctx.config.role == "prefill":  # the router sends the full request to decode
            req.max_tokens, req.max_completion_tokens = 1, None
        rid, jobs = await self.start(raw, req)
        if req.stream:
            chunks = self.handler.stream(rid, req, jobs, chat)
            if self.ctx.config.role == "prefill":
                chunks = self._flush_before_done(chunks)
            return StreamingResponse(chunks, media_type="text/event-stream")
        if not await self.complete(raw, rid, jobs):
            return Response(status_code=499)
        errors = [j.last.error for j in jobs if j.last is not None and j.last.error]
        if errors:
            raise ApiError(500, errors[0])
        if self.ctx.config.role == "prefill":
            await self.flush_offload()
        if isinstance(req, ChatCompletionRequest):
            return JSONResponse(self.handler.chat_body(rid, req, jobs))
        return JSONResponse(self.handler.completion_body(rid, req, jobs))

    async def complete(self, raw: Request, rid: str, jobs: list[Job]) -> bool:
        """Wait for every job to finish; False (all aborted) if the client went away."""
        task = asyncio.create_task(self.handler.complete(rid, jobs))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    return False
            task.result()
        except RequestTimeoutError as e:
            raise ApiError(408, str(e), "timeout") from None
        finally:
            for job in jobs:
                job.stream.close()
        return True

    async def _flush_before_done(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """A prefill replica's stream: ``[DONE]`` only once the tiers hold the prompt's
        blocks, as the non-stream answer waits (only that path used to flush)."""
        async for chunk in chunks:
            if chunk == DONE:
                await self.flush_offload()
            yield chunk

    async def flush_offload(self) -> None:
        """Prefill role: answer once the prompt's blocks are in the shared tier.

        The step that finished the request queued its blocks for storing before the
        output was delivered, so waiting for the store queue to drain is enough.
        """
        wait = self.ctx.config.prefill_flush_timeout_s
        if not await self.ctx.engine.flush_offload(wait):
            logger.warning("prefill: KV stores still queued after %.0fs", wait)
