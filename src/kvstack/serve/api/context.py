"""What the server's route modules share: its options and the request checks.

``ServerContext`` holds the ``AsyncEngine`` and the ``ServerConfig`` and turns raw
requests into validated ones, raising ``ApiError`` (an OpenAI error object with its
status) for anything wrong, so no malformed input reaches the engine: bodies are read
under ``max_body_bytes``, decoded as UTF-8, parsed as JSON (nesting bounded by the
recursion limit; no NaN, over-long integer or lone surrogate: ``json_body.py``), required
to be objects, and only then validated by pydantic. Fields
no model declares are ignored, logged and named in the response's
``kvstack-ignored-fields`` header (``serve/api/leniency.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvstack.core.errors import InvalidRequestError
from kvstack.serve.api.endpoints import DEFAULT_OPEN_ENDPOINTS, OPS_ENDPOINTS, open_endpoints
from kvstack.serve.api.http_errors import ApiError, check_bearer, read_body
from kvstack.serve.api.json_body import BodyError, load_json
from kvstack.serve.api.leniency import note_ignored
from kvstack.serve.api.protocol import TokenizeRequest
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.chat.messages import ChatMessage, ignored_fields
from kvstack.serve.chat.prompt import chat_prompt_ids
from kvstack.serve.chat.reasoning_parsers import ReasoningParser, check_template
from kvstack.serve.chat.segments import chat_segments
from kvstack.serve.chat.tool_calls import ToolPlan
from kvstack.serve.conversation_options import ConversationOptions
from kvstack.serve.frontend_options import FrontendOptions

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
# Threads that tokenize and render chat templates off the event loop: a 2 MB prompt takes
# seconds of CPU, and on the loop it stalled /health past the router's 2 s timeout, so
# the router ejected a healthy replica. Two: more only queue for the GIL; requests past
# them wait their turn.
CPU_WORKERS = 2
# Bodies larger than this are parsed and validated in those threads too (a small one is
# faster on the loop than the hand-off).
OFF_LOOP_BYTES = 64 * 1024


@dataclass
class ServerConfig:
    model_name: str
    model_aliases: tuple[str, ...] = ()  # --served-model-name's other names (vLLM's)
    allowed_origins: tuple[str, ...] = ()  # CORS (--allowed-origins); empty: no CORS
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout_s: float | None = 30.0  # the whole body must arrive within it (408)
    request_timeout_s: float | None = None
    max_sequences_per_request: int = 64  # prompts x n (--max-sequences-per-request)
    shutdown_grace_s: float = 30.0
    # Prefill/decode split (``--role``): a prefill replica computes the prompt's KV, waits
    # until its offload tiers hold it, and answers one token; "both" is a plain server.
    role: str = "both"
    prefill_flush_timeout_s: float = 30.0
    # Tools (``serve/chat/tool_calls.py``): --tool-call-parser, --enable-auto-tool-choice.
    tool_call_parser: str = "hermes"
    enable_auto_tool_choice: bool = True
    # --reasoning-parser, reasoning history and the Responses store's bounds.
    conversation: ConversationOptions = field(default_factory=ConversationOptions)
    # With ``api_key``: the ``OPS_ENDPOINTS`` that still need no key (SECURITY.md).
    open_endpoints: frozenset[str] = field(
        default_factory=lambda: open_endpoints(DEFAULT_OPEN_ENDPOINTS)
    )
    frontend: FrontendOptions = field(default_factory=FrontendOptions)  # vLLM's front end
    identity: str = ""  # the model and engine options, hashed into system_fingerprint


def decode_json(body: bytes) -> dict[str, Any]:
    """``body`` (UTF-8 JSON, an object) decoded; ``ApiError`` 400 naming the first problem
    (its field as ``param`` when ``json_body`` names one)."""
    try:
        data = load_json(body)
    except BodyError as e:  # NaN, a huge integer, a lone surrogate: named (json_body)
        raise ApiError(400, str(e), param=e.param) from None
    except UnicodeDecodeError:
        raise ApiError(400, "request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"malformed JSON: {e.msg} at position {e.pos}") from None
    except RecursionError:
        raise ApiError(400, "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def validate_body(data: dict[str, Any], model: type[M]) -> M:
    """``data`` validated as ``model``; ``ApiError`` 400 naming the first problem's field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}", param=param) from None
    except RecursionError:
        raise ApiError(400, "JSON nested too deeply") from None


class ServerContext:
    """The engine, the options and the checks every route applies."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        conv = config.conversation  # a parser that does not fit the template: start-up error
        self.reasoning: ReasoningParser | None = None
        if conv.reasoning_parser is not None:
            template = self.tokenizer.chat_template
            self.reasoning = check_template(conv.reasoning_parser, template, config.model_name)
        self._cpu = ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="kvstack-tokenize")

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (tokenizing, templating: CPU work) in a worker thread, so the event
        loop keeps answering while it runs."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn)

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def count_error(self, status: int) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.http_errors.labels(str(status)).inc()

    def count_internal(self) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.internal_errors.labels("http").inc()

    def check_auth(self, raw: Request) -> None:
        """401 unless the request carries the API key (none configured: open)."""
        check_bearer(raw, self.config.api_key)

    def check_ops_auth(self, raw: Request, endpoint: str) -> None:
        """401 unless ``endpoint`` (one of ``OPS_ENDPOINTS``) is open or the key is sent."""
        assert endpoint in OPS_ENDPOINTS, endpoint
        if endpoint not in self.config.open_endpoints:
            check_bearer(raw, self.config.api_key)

    def check_model(self, name: str | None) -> None:
        """404 for a model name other than the served ones (None: the served one); a
        LoRA adapter's name is such a name, since kvstack loads none."""
        c = self.config
        if name is not None and name != c.model_name and name not in c.model_aliases:
            served = ", ".join((c.model_name, *c.model_aliases))
            raise ApiError(  # vLLM's NotFoundError (serve/engine/serving.py), code 404
                404, f"The model `{name}` does not exist. Valid aliases: {served}.",
                "NotFoundError", param="model",
            )  # fmt: skip

    async def parse(self, raw: Request, model: type[M]) -> M:
        """The body as ``model``; 413 / 400 with the first problem found. A body over
        ``OFF_LOOP_BYTES`` is decoded and validated in a worker thread: a 5 MB body is
        seconds of CPU, and on the loop it stalled ``/health`` for 7.8 s."""
        body = await read_body(raw, self.config.max_body_bytes, self.config.body_timeout_s)

        def work() -> tuple[M, list[str]]:
            parsed = validate_body(decode_json(body), model)
            return parsed, ignored_fields(parsed)  # walks every message: CPU too

        parsed, ignored = await self.off_loop(work) if len(body) > OFF_LOOP_BYTES else work()
        note_ignored(raw, ignored)
        return parsed

    async def parse_first(self, raw: Request, models: tuple[type[BaseModel], ...]) -> BaseModel:
        """The body as the first of ``models`` it validates as (vLLM's SageMaker
        ``/invocations`` dispatch by shape); 400 naming the expected types if none. Large
        bodies are decoded off the loop, as in ``parse``."""
        body = await read_body(raw, self.config.max_body_bytes, self.config.body_timeout_s)

        def work() -> tuple[BaseModel, list[str]] | None:
            data = decode_json(body)
            for model in models:
                try:
                    model.model_validate(data)
                except (ValidationError, RecursionError):
                    continue
                parsed = validate_body(data, model)
                return parsed, ignored_fields(parsed)
            return None

        found = await self.off_loop(work) if len(body) > OFF_LOOP_BYTES else work()
        if found is None:
            names = [m.__name__ for m in models]
            raise ApiError(
                400, f"Cannot find suitable handler for request. Expected one of: {names}"
            )
        note_ignored(raw, found[1])
        return found[0]

    def ids_of(
        self,
        prompt: str | list[int] | None,
        messages: list[ChatMessage] | None,
        add_generation_prompt: bool,
        add_special_tokens: bool,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: TokenizeRequest | None = None,  # its tools, tool_choice and documents
    ) -> list[int]:
        """Token ids of exactly one of ``prompt`` (text or ids) or ``messages`` (templated
        as a chat completion templates them: ``protocol.chat_prompt_ids``, with the tools
        and documents of ``tools``)."""
        if (prompt is None) == (messages is None):
            raise ApiError(400, "give exactly one of prompt or messages")
        tok = self.tokenizer
        try:
            if tools is not None and (tools.tools or tools.documents) and messages is None:
                raise InvalidRequestError("tools and documents need messages", param="tools")
            if messages is not None:
                plan = None if tools is None else ToolPlan.build(
                    tools.tools, tools.tool_choice, None, self.config.tool_call_parser
                )  # fmt: skip
                kw: dict[str, Any] = dict(
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs, plan=plan,
                    documents=None if tools is None else tools.documents,
                )  # fmt: skip
                seg = chat_segments(tok, messages, **kw) if self.engine.segments_enabled else None
                return seg[0] if seg is not None else chat_prompt_ids(tok, messages, **kw)
            if isinstance(prompt, str):
                return tok.encode(prompt, add_special_tokens=add_special_tokens)
            return list(prompt or [])
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
