"""OpenAI request bodies (and vLLM's extra sampling fields), validated with pydantic.

Unknown fields are rejected (``extra="forbid"``) the way OpenAI's API rejects an
unrecognized argument, so a typo never silently changes sampling. Ranges that the
engine already checks (``SamplingParams.validate``) are left to it, so there is one
source of truth for what a valid request is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from kvstack.errors import InvalidRequestError
from kvstack.request import SamplingParams

MAX_N = 16
MAX_STOP = 8
MAX_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
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
    seed: StrictInt | None = None
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
    # vLLM: logprobs of every prompt token (null first), in the response's
    # ``prompt_logprobs`` (completions: per choice; chat: top level).
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # kvstack extension (era 5): a KV press for this request (``kv/press/``).
    kv_press: str | None = None
    kv_press_ratio: float | None = None
    kv_press_every: StrictInt | None = None

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
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not both")
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def _sampling_params(
        self, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        if self.stream and self.prompt_logprobs:  # vLLM: never streamed
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream=true", param="prompt_logprobs"
            )
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
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=self._max_tokens(),
            min_tokens=self.min_tokens,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            kv_press=self.kv_press,
            kv_press_ratio=self.kv_press_ratio,
            kv_press_every=self.kv_press_every,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = str | list[StrictInt] | list[str] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    prompt: PromptType
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
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

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (vLLM): answer the prompt, generate nothing."""
        return self.echo and self._max_tokens() == 0

    def sampling_params(self) -> SamplingParams:
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
        sp = self._sampling_params(self.logprobs, pl)
        if self.echo_only:  # one token is computed (and not returned), as vLLM does
            sp.max_tokens = 1
        return sp


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: prepend the last message to the answer when it has the answer's role.
    echo: StrictBool = False

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = {"messages", "add_generation_prompt", "tokenize", "tools", "documents",
                    "chat_template", "continue_final_message"}  # fmt: skip
        if v and reserved & set(v):
            raise ValueError(f"may not set {sorted(reserved & set(v))}")
        return v

    def template_messages(self) -> list[dict[str, str]]:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError(
                "cannot set both continue_final_message and add_generation_prompt to true",
                param="continue_final_message",
            )
        out = []
        for i, m in enumerate(self.messages):
            text = m.text()
            if not text and m.role != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}] ({m.role}) has empty content", param=f"messages.{i}.content"
                )
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
        return out

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        pl = self.prompt_logprobs
        if pl is None and self.echo and not self.stream:  # vLLM; a stream never shows them
            pl = self.top_logprobs or 0
        return self._sampling_params((self.top_logprobs or 0) if self.logprobs else None, pl)

    @property
    def response_role(self) -> str:
        """vLLM: "assistant", or the last message's role without a generation prompt."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echo_text(self) -> str:
        """What ``echo`` prepends: the last message if it has the answer's role."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role else ""


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]


class PinRequest(_Strict):
    """``POST /v1/cache/pin`` and ``/v1/cache/unpin``: a prefix as text, ids or messages."""

    model: str | None = None
    prompt: str | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
