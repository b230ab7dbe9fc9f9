"""OpenAI request bodies (and vLLM's extra sampling fields), validated with pydantic.

Leniency as vLLM's: a field no model declares is accepted and ignored (kept aside in
``model_extra``); ``ignored_fields`` lists them as dotted paths (``messages.0.foo``,
``stream_options.bar``) so the server can log them and answer them in the
``kvstack-ignored-fields`` header: a typo never silently passes unnoticed. Known fields
stay strictly typed (a wrong type is a 400 naming the field). Ranges that the engine
already checks (``SamplingParams.validate``) are left to it, so there is one source of
truth for what a valid request is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    field_validator,
)

from kvstack.core.errors import InvalidRequestError
from kvstack.core.prompts import check_cache_salt
from kvstack.core.request import SamplingParams
from kvstack.model.tokenizer.tokenizer import RESERVED_TEMPLATE_KWARGS, Tokenizer
from kvstack.serve.api.protocol_tools import (
    MAX_TOOLS,
    StructuredFields,
    ToolChoice,
    ToolDef,
)
from kvstack.serve.chat.documents import MAX_DOCUMENTS
from kvstack.serve.chat.messages import ChatMessage, StrictBody
from kvstack.serve.chat.prompt import chat_prompt_ids
from kvstack.serve.chat.segments import Mark, chat_segments
from kvstack.serve.chat.tool_calls import ToolPlan

MAX_N = 16
MAX_STOP = 8
MAX_LOGPROBS = 20
# Bounds checked by validation, before any templating or tokenizing: a long agent
# conversation has hundreds of messages and a message a few parts; past these a body is
# an attack (150,000 messages took seconds of CPU to template, cubic segment location
# with 1,000 parts 31 s), answered 400 naming the field.
MAX_MESSAGES = 16384


class StreamOptions(StrictBody):
    include_usage: StrictBool = False
    # vLLM: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: StrictBool = False


class _Sampling(StrictBody, StructuredFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # vLLM's int64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    cache_salt: str | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    # vLLM: logprobs of every prompt token (null first), in the response's
    # ``prompt_logprobs`` (completions: per choice; chat: top level).
    prompt_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None  # <= --max-logprobs
    # vLLM's output options: each choice's token ids (and the prompt's), logprob tokens
    # as 'token_id:N' (default: --return-tokens-as-token-ids); beam search is refused.
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    use_beam_search: StrictBool = False
    # kvstack extension (KV compression): a KV press for this request (``kv/press/``).
    kv_press: str | None = None
    kv_press_ratio: float | None = None
    kv_press_every: StrictInt | None = None

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, v: str | None) -> str | None:
        return check_cache_salt(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop sequences must not be empty")
        return v

    def _max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError(
                "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens"
            )
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def _sampling_params(
        self,
        logprobs: int | None,
        defaults: Mapping[str, Any] | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The request's ``SamplingParams``; a field it leaves unset takes the value of
        ``defaults`` (the generation config's, ``--generation-config``) if any, but
        ``max_tokens``, which the engine resolves (``LLMEngine.add_request``)."""
        if self.stream and self.prompt_logprobs:  # vLLM: never streamed
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream=true", param="prompt_logprobs"
            )
        d = defaults or {}

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else d.get(name, fallback)

        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = float(value)
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=self._max_tokens(),  # None: the engine's default (generation config)
            min_tokens=self.min_tokens,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            kv_press=self.kv_press,
            kv_press_ratio=self.kv_press_ratio,
            kv_press_every=self.kv_press_every,
            bad_words=list(self.bad_words or []),
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_params(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM: ``continuous_usage_stats`` with
        ``include_usage``)."""
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )


PromptType = str | list[StrictInt] | list[str] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    max_tokens: StrictInt | None = 16  # vLLM's default (null: up to the context's end)
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = None  # <= --max-logprobs
    suffix: None = None  # not supported; present so the error names the field
    best_of: None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of texts or token-id lists (a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def _max_tokens(self) -> int | None:
        if "max_tokens" not in self.model_fields_set and self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super()._max_tokens()

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (vLLM): answer the prompt, generate nothing."""
        return self.echo and self._max_tokens() == 0

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        # vLLM: echo with logprobs scores the prompt too (at the same top-k).
        pl = self.prompt_logprobs
        if pl is None and self.echo:
            pl = self.logprobs
        if self._max_tokens() == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens must be at least 1 (0 only with echo)", param="max_tokens"
            )
        if self.echo_only and self.min_tokens:
            raise InvalidRequestError("min_tokens needs max_tokens > 0", param="min_tokens")
        sp = self._sampling_params(self.logprobs, defaults, pl)
        if self.echo_only:  # one token is computed (and not returned), as vLLM does
            sp.max_tokens = 1
        return sp


def _check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """No name of the render path's own parameters (``source``, ``self``, ``tokenize``...):
    passing one would be a TypeError inside the handler, a 500 any client could trigger."""
    if v and RESERVED_TEMPLATE_KWARGS & set(v):
        raise ValueError(f"may not set {sorted(RESERVED_TEMPLATE_KWARGS & set(v))}")
    return v


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None  # <= --max-logprobs
    chat_template: str | None = None  # only with --trust-request-chat-template
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    documents: Annotated[list[dict[str, Any]], Field(max_length=MAX_DOCUMENTS)] | None = None
    # vLLM: prepend the last message to the answer when it has the answer's role.
    echo: StrictBool = False
    _plan: ToolPlan | None = PrivateAttr(default=None)
    _role: str = PrivateAttr(default="assistant")

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    def tool_plan(self, parser: str = "hermes", auto_enabled: bool = True) -> ToolPlan | None:
        """Build (once) what the request's tools mean (``chat/tool_calls.py``); 400 if invalid."""
        if self._plan is None and self.tools:
            self._plan = ToolPlan.build(
                self.tools, self.tool_choice, self.parallel_tool_calls, parser, auto_enabled
            )
        elif not self.tools:
            ToolPlan.build(None, self.tool_choice, None, parser)  # tool_choice without tools
        return self._plan

    def segments(self, tokenizer: Tokenizer) -> tuple[list[int], list[Mark]] | None:
        """``prompt_ids`` with its tools, documents and marked parts as segments (segment reuse,
        ``serve/chat/segments.py``); None when it has none. Call ``tool_plan`` first."""
        if self.chat_template is not None:  # the request's own template: rendered whole
            return None
        return chat_segments(
            tokenizer, self.messages, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs, plan=self._plan,
            documents=self.documents,
        )  # fmt: skip

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The conversation's token ids (``InvalidRequestError`` if it cannot be rendered);
        call ``tool_plan`` first when the request has tools."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.chat_template is not None:  # checked against --trust-request-chat-template
            kwargs["chat_template"] = self.chat_template
        return chat_prompt_ids(
            tokenizer, self.messages, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=kwargs or None, plan=self._plan,
            documents=self.documents,
        )  # fmt: skip

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        lp = (self.top_logprobs or 0) if self.logprobs else None
        pl = self.prompt_logprobs
        if pl is None and self.echo and not self.stream:  # vLLM; a stream never shows them
            pl = self.top_logprobs or 0
        sp = self._sampling_params(lp, defaults, pl)
        if self._plan is not None and self._plan.mode != "none":
            sp.skip_special_tokens = False  # vLLM: a call marker may be a special token
        forced = None if self._plan is None else self._plan.constraint()
        if forced is not None:
            if sp.structured_outputs is not None:
                raise InvalidRequestError(
                    "a forced tool_choice cannot be combined with another output constraint",
                    param="tool_choice",
                )
            sp.structured_outputs = forced
        return sp

    @property
    def response_role(self) -> str:
        """vLLM: the server's ``--response-role`` ("assistant"), or the last message's role
        without a generation prompt."""
        return self._role if self.add_generation_prompt else self.messages[-1].role

    def use_response_role(self, role: str) -> None:
        """The role answers take under a generation prompt (``--response-role``)."""
        self._role = role

    def echo_text(self) -> str:
        """What ``echo`` prepends: the last message if it has the answer's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role else ""


class TokenizeRequest(StrictBody):
    """``POST /tokenize``: a prompt, or messages rendered exactly as a chat renders them
    (with the same ``tools`` and ``documents``)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    documents: Annotated[list[dict[str, Any]], Field(max_length=MAX_DOCUMENTS)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool | None = False  # vLLM: also each token's vocabulary string

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[StrictInt]


class PinRequest(StrictBody):
    """``POST /v1/cache/pin`` and ``/v1/cache/unpin``: a prefix as text, ids or messages."""

    model: str | None = None
    prompt: str | list[StrictInt] | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    cache_salt: str | None = None

    _salt = field_validator("cache_salt")(check_cache_salt)


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, PinRequest,
)  # fmt: skip
"""The request bodies ``/openapi.json`` documents (``serve/api/openapi.py``)."""


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
