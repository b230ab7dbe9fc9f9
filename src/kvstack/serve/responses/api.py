"""``/v1/responses``: OpenAI's Responses API on the chat path, with server-side state.

``POST /v1/responses`` turns the body into a chat request (``protocol_responses.py``:
sampling, tools, ``text.format`` as ``response_format``), renders the prompt from the
instructions, the stored conversation of ``previous_response_id`` and the new input
(``responses_prompt.py``), runs it through ``OpenAIHandler`` and answers OpenAI's
``response`` object or its event stream (``responses_events.py``). Usage is
``input_tokens`` / ``output_tokens`` with ``input_tokens_details.cached_tokens`` (prefix
cache hits) and ``kvstack_pinned_tokens`` (hits the previous turn had pinned for this
one), and ``output_tokens_details.reasoning_tokens`` (the reasoning's tokens).

With ``store`` (the default, as OpenAI's) the response, its conversation and its tokens
are kept (``responses_store.py``) for ``GET /v1/responses/{id}``, ``DELETE`` and the next
turn, whose prefix is then known: its KV is softly pinned until that turn runs. A
``previous_response_id`` that is unknown, expired or deleted is vLLM's 404
(``Response with id '...' not found.``). ``background`` is refused (400), and so
``POST /v1/responses/{id}/cancel`` answers vLLM's 400 for a synchronous response.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import CompletionOutput
from kvstack.serve.api.http_errors import ApiError
from kvstack.serve.api.jobs import Job, usage
from kvstack.serve.api.protocol import ChatCompletionRequest
from kvstack.serve.api.routes_openai import OpenAIRoutes, Prompts
from kvstack.serve.chat.reasoning_parsers import ReasoningSplit
from kvstack.serve.chat.tool_calls import ToolPlan
from kvstack.serve.output_stream import RequestTimeoutError
from kvstack.serve.responses.events import EventWriter, output_items
from kvstack.serve.responses.prompt import prompt_ids, render_key, turn_messages
from kvstack.serve.responses.protocol import ResponsesRequest
from kvstack.serve.responses.store import (
    ConversationPins,
    ResponsesStore,
    StoredResponse,
    new_response_id,
)


@dataclass
class Turn:
    """One ``POST /v1/responses`` while it runs."""

    id: str
    req: ResponsesRequest
    chat: ChatCompletionRequest
    plan: ToolPlan | None
    prev: StoredResponse | None
    history: list[dict[str, Any]]  # the conversation through this turn's input
    key: str  # ``render_key``
    ids: list[int]
    jobs: list[Job]
    created: int


def not_found(response_id: str, param: str = "response_id") -> ApiError:
    """vLLM's 404 for a response id it does not hold."""
    # vLLM's responses handler names this one invalid_request_error (OpenAI's), not NotFoundError.
    message = f"Response with id '{response_id}' not found."
    return ApiError(404, message, "invalid_request_error", param=param, code=404)


class ResponsesHandler:
    """The Responses routes' logic over the chat routes (``OpenAIRoutes``)."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes
        self.ctx = routes.ctx
        opts = self.ctx.config.conversation
        self.keep = opts.reasoning_history == "keep"
        self.store = ResponsesStore(opts)
        self.pins = ConversationPins(self.ctx.engine, opts)

    async def create(self, raw: Request, req: ResponsesRequest) -> Response:
        ctx = self.ctx
        ctx.check_model(req.model)
        prev = None
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id, "previous_response_id")
        try:
            chat = req.chat_request(req.model)
            cfg = ctx.config
            plan = chat.tool_plan(cfg.tool_call_parser, cfg.enable_auto_tool_choice)
            messages, history = turn_messages(req.instructions, prev, req.input_messages())
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param=e.param) from None
        key = render_key(req.instructions, plan, req.chat_template_kwargs)
        keep = key if self.keep else None
        kw = req.chat_template_kwargs
        holder: list[list[int]] = []

        def render() -> Prompts:
            holder.append(prompt_ids(ctx.tokenizer, messages, plan, kw, prev, keep))
            return [(holder[0], None, None)]

        _, jobs = await self.routes.start(raw, chat, render, "responses")
        turn = Turn(new_response_id(), req, chat, plan, prev, history, key, holder[0], jobs,
                    int(time.time()))  # fmt: skip
        if req.stream:
            return StreamingResponse(self.stream(turn), media_type="text/event-stream")
        if not await self.routes.complete(raw, turn.id, jobs):
            return Response(status_code=499)
        last = jobs[0].last
        assert last is not None
        if last.error:
            raise ApiError(500, last.error)
        out = last.outputs[0]
        split = self.split(out.text)
        content, calls = (split.content, []) if plan is None else plan.parse(split.content or "")
        items = output_items(split.reasoning, content, calls)
        body = self.body(turn, items, out, split.reasoning)
        await self.finish(turn, body, items, out)
        return JSONResponse(body)

    def split(self, text: str) -> ReasoningSplit:
        parser = self.ctx.reasoning
        return parser.split(text) if parser is not None else ReasoningSplit(None, text)

    # ------------------------------------------------------------------ streaming
    async def stream(self, turn: Turn) -> AsyncIterator[str]:
        w = EventWriter()
        head = self.body(turn, [], None, None)
        yield w.lifecycle("response.created", head)
        yield w.lifecycle("response.in_progress", head)
        job = turn.jobs[0]
        think = self.ctx.reasoning.stream() if self.ctx.reasoning is not None else None
        tools = turn.plan.streamer() if turn.plan is not None else None
        sent, out, reasoning = 0, None, ""
        try:
            async for item in job.stream:
                job.last, out = item, item.outputs[0]
                if item.error:
                    yield w.event("error", code="server_error", message=item.error, param=None)
                    return
                delta, sent = out.text[sent:], len(out.text)
                done = out.finish_reason is not None
                r, text = think.feed(delta) if think is not None else ("", delta)
                if done and think is not None:
                    tail = think.finish()
                    r, text = r + tail[0], text + tail[1]
                reasoning += r
                for chunk in w.reasoning(r):
                    yield chunk
                events = tools.feed(text) + (tools.finish() if done else []) if tools else None
                for chunk in self._content(w, text, events):
                    yield chunk
        except RequestTimeoutError as e:
            yield w.event("error", code="timeout", message=str(e), param=None)
            return
        except Exception as e:  # a failed step: the stream ends with the error
            yield w.event("error", code="server_error", message=str(e) or type(e).__name__,
                          param=None)  # fmt: skip
            return
        finally:
            job.stream.close()
        for chunk in w.finish():
            yield chunk
        body = self.body(turn, w.items, out, reasoning or None)
        await self.finish(turn, body, w.items, out)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield w.lifecycle(kind, body)

    @staticmethod
    def _content(w: EventWriter, text: str, events: list[Any] | None) -> list[str]:
        if events is None:
            return w.text(text)
        out: list[str] = []
        for e in events:
            out += w.text(e.text) if hasattr(e, "text") else w.call(e)
        return out

    # ------------------------------------------------------------------ the response
    def body(
        self,
        turn: Turn,
        items: list[dict[str, Any]],
        out: CompletionOutput | None,
        reasoning: str | None,
    ) -> dict[str, Any]:
        """The response object (``in_progress`` with no output while ``out`` is None)."""
        req = turn.req
        status, incomplete = "in_progress", None
        if out is not None:
            cut = out.finish_reason == "length"
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {
            "id": turn.id, "object": "response", "created_at": turn.created,
            "status": status, "background": False, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "model": self.ctx.config.model_name, "output": items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "service_tier": "auto", "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "tool_choice": _dump(req.tool_choice) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": req.truncation or "disabled", "user": req.user,
            "usage": self.usage(turn, reasoning) if out is not None else None,
        }  # fmt: skip

    def usage(self, turn: Turn, reasoning: str | None) -> dict[str, Any]:
        u = usage(turn.jobs)
        n_reason = len(self.ctx.tokenizer.encode(reasoning, add_special_tokens=False)) if (
            reasoning
        ) else 0  # fmt: skip
        details = {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
        if turn.prev is not None:  # the hits the previous turn had pinned for this one
            details["kvstack_pinned_tokens"] = self.pins.hit(turn.prev, turn.ids)
        return {
            "input_tokens": u["prompt_tokens"], "input_tokens_details": details,
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": n_reason},
            "total_tokens": u["total_tokens"],
        }  # fmt: skip

    async def finish(
        self, turn: Turn, body: dict[str, Any], items: list[dict[str, Any]], out: Any
    ) -> None:
        """Store the turn (``store``) and keep its KV for the next one; the previous
        turn's pin has served its purpose."""
        if turn.prev is not None:
            await self.pins.release(turn.prev)
        if not turn.req.store or out is None:
            return
        rec = StoredResponse(
            turn.id, body, [*turn.history, *_answer_messages(items)], turn.ids,
            list(out.token_ids), turn.chat.cache_salt, turn.key,
        )  # fmt: skip
        for dropped in self.store.put(rec):
            await self.pins.release(dropped)
        if self.store.get(rec.id) is not None:
            # Under keep the next turn starts with all of these tokens; under strip only
            # the prompt is sure to be reused (the template re-renders the answer).
            await self.pins.pin(rec, [*turn.ids, *out.token_ids] if self.keep else turn.ids)

    # ------------------------------------------------------------------ GET / DELETE
    def get(self, response_id: str) -> dict[str, Any]:
        rec = self.store.get(response_id)
        if rec is None:
            raise not_found(response_id)
        return rec.body

    async def delete(self, response_id: str) -> dict[str, Any]:
        rec = self.store.delete(response_id)
        if rec is None:
            raise not_found(response_id)
        await self.pins.release(rec)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def cancel(self, response_id: str) -> NoReturn:
        self.get(response_id)  # 404 first
        raise ApiError(400, "Cannot cancel a synchronous response.", param="response_id")


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def _answer_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answer as one assistant message for the next turn's template."""
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            msg["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            msg["content"] = item["content"][0]["text"]
        elif item["type"] == "function_call":
            call = {"name": item["name"], "arguments": item["arguments"]}
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    return [msg]
