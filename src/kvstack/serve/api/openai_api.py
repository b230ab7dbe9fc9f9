"""``/v1/completions`` and ``/v1/chat/completions``: engine outputs to OpenAI responses.

A completions request with several prompts becomes one engine request per prompt;
choice ``i * n + j`` is completion ``j`` of prompt ``i`` (OpenAI's order). Streaming
sends, per step, each choice's new text as an SSE ``data:`` chunk, then the finish
reason, an optional usage chunk (``stream_options.include_usage``; with vLLM's
``continuous_usage_stats`` every chunk also carries the usage so far) and ``[DONE]``::

    data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    data: {"choices": [{"index": 0, "delta": {"content": " Paris"}}]}
    data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    data: {"choices": [], "usage": {...}}
    data: [DONE]

``echo`` (vLLM's semantics): a completion's text and ``logprobs`` start with the
prompt's (its logprobs are computed as ``prompt_logprobs`` at the ``logprobs`` top-k, the
first entry ``null``; streamed in each choice's first chunk; ``max_tokens: 0`` answers
the prompt alone; streamed ``text_offset`` values run on across chunks, so the chunks add
up to the unstreamed answer, where vLLM restarts them at the generated text's length); a
chat answer starts with the last message when that message has the answer's role
(``add_generation_prompt: false``). vLLM's ``prompt_logprobs`` come back per choice
(completions) or at the top level (chat), formatted by ``logprob_format``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import CompletionOutput, SamplingParams
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.serve.api.jobs import ChoiceState, Job, merged_outputs, usage
from kvstack.serve.api.logprob_format import (
    TokenIdNames,
    chat_logprobs,
    completion_logprobs,
    next_offset,
    prompt_logprobs_json,
)
from kvstack.serve.api.protocol import ChatCompletionRequest, CompletionRequest, error_body
from kvstack.serve.api.vllm_checks import fit_context, tokens_as_ids
from kvstack.serve.async_engine import AsyncEngine
from kvstack.serve.chat.reasoning_parsers import ReasoningParser, ReasoningSplit
from kvstack.serve.chat.segments import Mark
from kvstack.serve.frontend_options import FrontendOptions
from kvstack.serve.output_stream import RequestInfo, RequestTimeoutError


@dataclass
class ApiContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    request_timeout_s: float | None = None
    # Prompts x n one request may queue (a bound against fan-out: 32 id prompts x n=16 was
    # 512 sequences, and 64 x 16 filled --max-waiting for everyone else).
    max_sequences: int = 64
    reasoning: ReasoningParser | None = None  # --reasoning-parser
    frontend: FrontendOptions = field(default_factory=FrontendOptions)  # vLLM's flags
    fingerprint: str | None = None  # system_fingerprint (FrontendOptions.fingerprint)


def _new_state(
    req: CompletionRequest | ChatCompletionRequest, reasoning: ReasoningParser | None
) -> ChoiceState:
    chat = isinstance(req, ChatCompletionRequest)
    plan = req.tool_plan() if isinstance(req, ChatCompletionRequest) else None
    think = reasoning.stream() if chat and reasoning is not None else None
    return ChoiceState(tools=None if plan is None else plan.streamer(), reasoning=think)


class OpenAIHandler:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx

    async def start(
        self,
        prompts: list[tuple[list[int], str | None, list[Mark] | None]],
        req: CompletionRequest | ChatCompletionRequest,
        sp: SamplingParams,
        endpoint: str,
        session_id: str | None,
    ) -> tuple[str, list[Job]]:
        """Queue every prompt with ``sp`` (``req.sampling_params``, computed by the caller
        off the event loop); on any error abort those already queued and re-raise.

        A prompt is cut to its last ``truncate_prompt_tokens`` here (not only in the
        engine), so usage and ``echo`` see the prompt the engine ran."""
        engine = self.ctx.engine
        if len(prompts) * sp.n > self.ctx.max_sequences:
            raise InvalidRequestError(
                f"{len(prompts)} prompts x n={sp.n} is {len(prompts) * sp.n} sequences; a "
                f"request may ask for at most {self.ctx.max_sequences} "
                "(--max-sequences-per-request)",
                param="n",
            )
        base = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        jobs: list[Job] = []
        try:
            for i, (full, full_text, spans) in enumerate(prompts):
                ids = sp.truncate_prompt(full, engine.model_info.max_model_len)
                psp = fit_context(sp, len(ids), engine.model_info.max_model_len)
                whole = len(ids) == len(full)
                text = full_text if whole else None
                rid = base if len(prompts) == 1 else f"{base}-{i}"
                stream = await self.ctx.engine.add(
                    rid,
                    ids,
                    psp,
                    RequestInfo(endpoint, session_id),
                    cache_salt=req.cache_salt,
                    timeout_s=self.ctx.request_timeout_s,
                    segments=spans if whole else None,  # a cut prompt: marks no longer fit
                )
                jobs.append(Job(i, stream, ids, text))
        except BaseException:
            for job in jobs:
                job.stream.close()
            raise
        return base, jobs

    # ------------------------------------------------------------------ non-streaming
    async def complete(self, rid: str, jobs: list[Job]) -> None:
        try:
            lasts = await asyncio.gather(*(j.stream.final() for j in jobs))
        finally:
            for j in jobs:
                j.stream.close()
        for job, last in zip(jobs, lasts, strict=True):
            job.last = last

    def completion_body(self, rid: str, req: CompletionRequest, jobs: list[Job]) -> dict:
        tok, n = self.ctx.tokenizer, req.n
        choices = []
        for job in jobs:
            assert job.last is not None
            prompt_lps = prompt_logprobs_json(tok, job.last.prompt_logprobs)
            for c in job.last.outputs:
                piece = self.completion_piece(job, c, req, ChoiceState(), final=True)
                assert piece is not None
                text, lp = piece
                choices.append(
                    {
                        "index": job.index * n + c.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "prompt_logprobs": prompt_lps,
                        **_token_ids(req, c.token_ids, job.prompt_ids),
                    }
                )
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "system_fingerprint": self.ctx.fingerprint,
            "choices": choices,
            "usage": usage(jobs),
        }

    def completion_piece(
        self, job: Job, c: CompletionOutput, req: CompletionRequest, st: ChoiceState, final: bool
    ) -> tuple[str, dict | None] | None:
        """Text and ``logprobs`` of choice ``c`` not sent yet (all of it for a fresh
        ``st``). With ``echo`` the prompt goes first, once its logprobs are all there
        (None until then); ``echo_only`` (``max_tokens: 0``) sends only the prompt.
        ``final``: an empty ``logprobs`` object rather than None when nothing is new."""
        tok = self.ctx.tokenizer
        text, ids, entries = "", [], []
        if req.echo and not st.echoed:
            plp = list(job.last.prompt_logprobs or []) if job.last else []
            n_prompt = len(job.prompt_ids)
            if req.logprobs is not None and len(plp) < n_prompt and c.finish_reason is None:
                return None
            text = job.prompt_text or tok.decode(job.prompt_ids, skip_special_tokens=False)
            ids = list(job.prompt_ids)
            entries = (plp or [None]) + [None] * (n_prompt - max(len(plp), 1))
            st.echoed = True
        if not req.echo_only:
            text += c.text[st.text_sent :]
            out_lps = (c.logprobs or [])[st.lp_sent :]
            ids += c.token_ids[st.lp_sent : st.lp_sent + len(out_lps)]
            entries += out_lps
        st.text_sent = len(c.text)
        st.lp_sent = len(c.logprobs or [])
        lp = None
        if req.logprobs is not None and (ids or final):
            lp = completion_logprobs(self._names(req), ids, entries, req.logprobs, st.offset)
            st.offset = next_offset(lp, st.offset)
        return text, lp

    def chat_body(self, rid: str, req: ChatCompletionRequest, jobs: list[Job]) -> dict:
        tok = self.ctx.tokenizer
        job = jobs[0]
        assert job.last is not None
        plan = req.tool_plan()
        echo = req.echo_text()
        choices = []
        think = self.ctx.reasoning
        for c in job.last.outputs:
            split = think.split(c.text) if think is not None else ReasoningSplit(None, c.text)
            text = split.content or ""
            content, calls = (text, []) if plan is None else plan.parse(text)
            if echo:  # vLLM: the last message, then the answer
                content = echo + (content or "")
            message: dict[str, Any] = {"role": req.response_role, "content": content}
            if think is not None:  # vLLM's field (``reasoning_content`` before vLLM 0.11)
                message["reasoning"] = split.reasoning
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(self._names(req), c, 0, req.top_logprobs or 0)
                    if req.logprobs
                    else None,
                    "finish_reason": "tool_calls" if calls else c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **_token_ids(req, c.token_ids, None),
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "system_fingerprint": self.ctx.fingerprint,
            "choices": choices,
            "usage": usage(jobs),
            **({"prompt_token_ids": job.prompt_ids} if req.return_token_ids else {}),
            "prompt_logprobs": prompt_logprobs_json(tok, job.last.prompt_logprobs),
        }

    # ------------------------------------------------------------------ streaming
    async def stream(
        self,
        rid: str,
        req: CompletionRequest | ChatCompletionRequest,
        jobs: list[Job],
        chat: bool,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        outputs, tasks = merged_outputs(jobs)
        try:
            async for job, item in outputs:
                if isinstance(item, BaseException):
                    msg = str(item) or type(item).__name__
                    if isinstance(item, RequestTimeoutError):
                        yield _sse(error_body(msg, "timeout", code=408))
                    else:
                        yield _sse(error_body(msg, "InternalServerError", code=500))
                    yield "data: [DONE]\n\n"
                    return
                job.last = item
                choices = [
                    ch
                    for c in item.outputs
                    if (ch := self._delta(job, c, req, chat)) is not None
                ]  # fmt: skip
                if item.error:
                    yield _sse(error_body(item.error, "InternalServerError", code=500))
                if choices:
                    chunk = {"id": rid, "object": obj, "created": created,
                             "model": self.ctx.model_name, "choices": choices,
                             "system_fingerprint": self.ctx.fingerprint}  # fmt: skip
                    if req.continuous_usage:  # vLLM's continuous_usage_stats: usage so far
                        chunk["usage"] = usage(jobs)
                    yield _sse(chunk)
            if req.include_usage:
                head = {"id": rid, "object": obj, "created": created, "model": self.ctx.model_name}
                yield _sse({**head, "choices": [], "usage": usage(jobs)})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for j in jobs:
                j.stream.close()

    def _delta(
        self,
        job: Job,
        c: CompletionOutput,
        req: CompletionRequest | ChatCompletionRequest,
        chat: bool,
    ) -> dict | None:
        st = job.choices.get(c.index) or job.choices.setdefault(
            c.index, _new_state(req, self.ctx.reasoning)
        )
        if st.done:
            return None
        first = not st.role_sent
        lp: dict | None = None
        if isinstance(req, CompletionRequest):
            piece = self.completion_piece(job, c, req, st, final=False)
            if piece is None:  # echo waits for the prompt's logprobs
                return None
            text, lp = piece
        else:
            text = c.text[st.text_sent :]
            n_lp = len(c.logprobs or [])
            if c.logprobs is not None and n_lp > st.lp_sent:
                lp = chat_logprobs(self._names(req), c, st.lp_sent, req.top_logprobs or 0)
            st.text_sent = len(c.text)
            st.lp_sent = n_lp
        st.role_sent = True
        st.done = c.finish_reason is not None
        if not (text or lp or first or st.done):
            return None
        index = c.index if chat else job.index * req.n + c.index
        out: dict[str, Any] = {"index": index, "logprobs": lp, "finish_reason": c.finish_reason}
        if isinstance(req, ChatCompletionRequest):
            thought = ""
            if st.reasoning is not None:  # <think>…</think> first, the rest is the answer
                thought, text = st.reasoning.feed(text)
                if st.done:
                    tail = st.reasoning.finish()
                    thought, text = thought + tail[0], text + tail[1]
            delta: dict[str, Any] = {"content": text}
            if st.tools is not None:
                delta = st.tools.delta(text, st.done)
                if st.done and st.tools.num_calls:
                    out["finish_reason"] = "tool_calls"
            if thought:
                delta["reasoning"] = thought
                if not delta.get("content"):
                    delta.pop("content", None)
            if first:
                delta["role"] = req.response_role
                if echo := req.echo_text():  # vLLM: the last message opens the answer
                    delta["content"] = echo + (delta.get("content") or "")
            worth = delta.get("content") or delta.get("tool_calls") or thought or first
            if not (worth or lp or st.done):
                return None  # a tool call's text is held back: nothing to send yet
            out["delta"] = delta if worth else {}
        else:
            out["text"] = text
        if st.done:
            out["stop_reason"] = c.stop_reason
        if req.return_token_ids:  # vLLM: each chunk's new ids, the prompt's with the first
            prompt = job.prompt_ids if first else None
            out.update(_token_ids(req, c.token_ids[st.ids_sent :], prompt))
            st.ids_sent = len(c.token_ids)
        return out

    def _names(self, req: CompletionRequest | ChatCompletionRequest) -> Any:
        """How logprobs name tokens: their text, or ``token_id:N`` (vLLM's
        ``return_tokens_as_token_ids``)."""
        return TokenIdNames() if tokens_as_ids(req, self.ctx.frontend) else self.ctx.tokenizer


def _token_ids(
    req: CompletionRequest | ChatCompletionRequest, ids: list[int], prompt: list[int] | None
) -> dict[str, Any]:
    """vLLM's ``token_ids`` (and ``prompt_token_ids``) of a choice, if the request asked."""
    if not req.return_token_ids:
        return {}
    return {"token_ids": list(ids), **({"prompt_token_ids": prompt} if prompt is not None else {})}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
