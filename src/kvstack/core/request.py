"""Requests, their sampling parameters, and the outputs returned to callers.

Field names follow vLLM (``SamplingParams``, ``RequestOutput``, ``CompletionOutput``) so
code written for vLLM's offline API reads the same here.

Token accounting of one request (vLLM v1 style: no separate prefill/decode phases)::

    |<------------- all_token_ids = prompt + output ------------->|
    |<--- num_computed_tokens --->|<- scheduled this step ->|
    |   KV already in the cache   |  KV written this step   |

A request samples a new token in a step exactly when, after that step,
``num_computed_tokens == num_tokens`` (its whole sequence has KV).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstack.core.errors import InvalidRequestError
from kvstack.core.segment_marks import SegmentMarks, check_recompute
from kvstack.core.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from kvstack.kv.press.state import PressState


MAX_BAD_WORDS = 128  # vLLM's limit per request
_FLOAT_PARAMS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "kv_press_ratio", "segment_recompute_ratio",
)  # fmt: skip


@dataclass
class SamplingParams:
    """How to sample a completion (vLLM's names and defaults).

    ``validate()`` raises ``InvalidRequestError`` with a clear message for any value out
    of range; the engine calls it before a request is queued.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # top-N logprobs per output token (0: only the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # KV press (``kv/press/``) for this request; None = the engine's --kv-press.
    kv_press: str | None = None
    kv_press_ratio: float | None = None  # fraction of KV removed, in [0, 1)
    # Press after this many prompt tokens instead of after the whole prompt (kvpress's
    # question-agnostic setting: compress a document, then read the question in full).
    kv_press_after: int | None = None
    # Press again every this many generated tokens, back to the first press's budget.
    kv_press_every: int | None = None
    # Segment reuse: repair of placed segments (None: the engine's --segment-recompute-*).
    segment_recompute_ratio: float | None = None
    segment_recompute_tokens: int | None = None
    # vLLM's: words that must not be generated (see ``resolve_bad_words``), the only
    # token ids that may be sampled (None: all), and how many prompt tokens to keep (the
    # last k; -1: max_model_len; None: all).
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # ``bad_words`` as token sequences: filled by the engine (``resolve_bad_words``).
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Structured outputs (vLLM's field): the output must match this schema / regex /
    # choice / grammar (``core/structured_outputs.py``; compiled in ``model/structured/``).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None) -> None:
        """``InvalidRequestError`` naming the field (its ``param``) of the first value out
        of range (vLLM's ranges)."""

        def bad(param: str, rule: str, value: object) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {rule}, got {value}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be at least 1", self.n)
        for name in _FLOAT_PARAMS:  # NaN passes every range check below (nan < 0 is False)
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise bad(name, "must be a finite number", value)
        if self.kv_press_after is not None and self.kv_press_after < 1:
            raise bad("kv_press_after", "must be at least 1", self.kv_press_after)
        if self.kv_press_every is not None and self.kv_press_every < 1:
            raise bad("kv_press_every", "must be at least 1", self.kv_press_every)
        if self.kv_press_ratio is not None and not 0.0 <= self.kv_press_ratio < 1.0:
            raise bad("kv_press_ratio", "must be in [0, 1)", self.kv_press_ratio)
        if self.segment_recompute_ratio is not None or self.segment_recompute_tokens is not None:
            check_recompute(
                0.0 if self.segment_recompute_ratio is None else self.segment_recompute_ratio,
                self.segment_recompute_tokens or 0,
            )
        if self.temperature < 0:
            raise bad("temperature", "must be non-negative", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or positive", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be positive", self.repetition_penalty)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1", self.max_tokens)
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be non-negative", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})",
                      self.min_tokens)  # fmt: skip
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", "must be in [0, 20]", self.logprobs)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", "must be in [0, 20]", self.prompt_logprobs)
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer", repr(self.seed))
        for tok, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= int(tok) < vocab_size:
                raise bad("logit_bias", f"token ids must be in [0, {vocab_size})", tok)
            if not -100.0 <= float(bias) <= 100.0:  # False for NaN too
                raise bad("logit_bias", "values must be in [-100, 100]", bias)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if not 0 <= tok < vocab_size:
                    raise bad("stop_token_ids", f"must be in [0, {vocab_size})", tok)
        self._validate_vllm_extras(vocab_size)

    def _validate_vllm_extras(self, vocab_size: int | None) -> None:
        """``bad_words``, ``allowed_token_ids`` and ``truncate_prompt_tokens`` (vLLM's rules)."""
        if len(self.bad_words) > MAX_BAD_WORDS or any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise InvalidRequestError(
                f"bad_words must be at most {MAX_BAD_WORDS} non-blank strings", param="bad_words"
            )
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise InvalidRequestError(
                    "allowed_token_ids must not be empty", param="allowed_token_ids"
                )
            limit = vocab_size if vocab_size is not None else float("inf")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limit
                   for t in allowed):  # fmt: skip
                raise InvalidRequestError(
                    f"allowed_token_ids must be token ids in [0, {vocab_size})",
                    param="allowed_token_ids",
                )
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or at least 1, got {k!r}",
                param="truncate_prompt_tokens",
            )

    def truncate_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: ``max_model_len``)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        self._validate_vllm_extras(None)
        if k > max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len})",
                param="truncate_prompt_tokens",
            )
        k = max_model_len if k == -1 else k
        return ids[-k:] if len(ids) > k else ids

    def resolve_bad_words(self, encode: Callable[[str], list[int]], vocab_size: int) -> None:
        """Fill ``bad_words_token_ids`` (vLLM's ``update_from_tokenizer``): each word is
        tokenized as given (leading spaces stripped) and, when that gives a new first token
        of the same length, once more after a space, so the word is banned at the start of
        the text and in the middle of it. ``encode`` adds no special tokens."""
        if not self.bad_words:
            self.bad_words_token_ids = None
            return
        out: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            spaced = encode(" " + word.lstrip())
            if not plain:
                raise InvalidRequestError(
                    f"bad word {word!r} encodes to no tokens", param="bad_words"
                )
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        if any(not 0 <= t < vocab_size for seq in out for t in seq):
            raise InvalidRequestError(
                f"bad_words encode to ids outside the vocabulary [0, {vocab_size})",
                param="bad_words",
            )
        self.bad_words_token_ids = out


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass
class Request:
    """One sequence being generated. ``n > 1`` is fanned out into n Requests by the engine.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; while running, the
    request's block table (held by the KV manager, ``get_block_ids``) covers at least
    ``num_kv_tokens`` slots.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (first schedule)
    # The same split by where the KV came from ("device", "host", "disk", "redis") when
    # offload tiers are on; None without them.
    cached_tokens_by_tier: dict[str, int] | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    # Sampled-token log-probabilities, filled only when sampling_params.logprobs is set.
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    # Extra key of the prefix-cache hash chain: requests only share KV with the same salt.
    cache_salt: str | None = None
    # Presses: the request's press and what it did (``kv/press/state.py``; None: never
    # pressed), set and changed only by the engine's ``PressCoordinator``. Positions keep
    # counting after a press; KV slots are compacted (``num_kv_tokens``).
    press: PressState | None = None
    # Chained hashes of the full blocks of all_token_ids, extended by the KV manager.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Speculative decoding (``spec/``): the proposer's guess of the tokens after
    # all_token_ids, verified next step. Never part of all_token_ids, never hashed.
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    spec_draft_len: int = 0  # the next draft's length (0: num_speculative_tokens)
    spec_misses: int = 0  # consecutive verifies that kept no draft
    spec_pause: int = 0  # steps left without a proposal (``spec/speculator.pause_after``)
    # Segment reuse: the prompt's reusable segments (``core/segment_marks.py``); once one is placed
    # (a copy of standalone KV), only blocks before ``cacheable_tokens`` are a true prefix.
    segments: SegmentMarks | None = None
    cacheable_tokens: int | None = None
    num_segment_tokens: int = 0  # prompt tokens copied from segments cached on arrival

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_dropped(self) -> int:
        """Cached tokens presses removed: 0 unless pressed."""
        return 0 if self.press is None else self.press.num_dropped

    @property
    def num_kv_tokens(self) -> int:
        """KV slots in use: computed tokens minus those a press removed.

        A token at position ``p`` computed after the press lives in slot
        ``p - num_dropped`` of the request's block table::

            positions:  0 1 2 3 4 5 6 7 8 9 | 10 11      (prompt of 10, 2 generated)
            kept:       0 1     4     7 8 9 | 10 11      (press kept 6 of 10)
            slots:      0 1     2     3 4 5 |  6  7      (num_dropped = 4)
        """
        return self.num_computed_tokens - self.num_dropped

    @property
    def press_applied(self) -> bool:
        """True once a press ran on the request's current KV (its blocks then no longer
        hold a token prefix, so the prefix cache must not take them)."""
        return self.press is not None and self.press.applied

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens ``start .. start + n`` of prompt + output, without joining the lists
        when the range lies in one of them."""
        p = self.num_prompt_tokens
        if start + n <= p:
            return self.prompt_token_ids[start : start + n]
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        return self.all_token_ids[start : start + n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        """Resolved max_tokens (the engine fills a None from the context length)."""
        mt = self.sampling_params.max_tokens
        assert mt is not None, "engine must resolve max_tokens before queueing"
        return mt

    def is_finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token, with its rank (1 = most likely) and decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Timestamps (``time.monotonic``) of one request, as vLLM's ``RequestOutput.metrics``.

    For ``n > 1`` the earliest first-token and the latest finish over the children.
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0  # summed over the children

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds (queueing + prefill)."""
        t = self.first_token_time
        return None if t is None else t - self.arrival_time


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns and ``LLMEngine.step`` streams, one per request id."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    # Where the cached tokens came from, with offload tiers: {"device": .., "disk": ..}.
    cached_tokens_by_tier: dict[str, int] | None = None
    # Segment reuse: prompt tokens of segments whose KV was already cached (copied, not computed),
    # and the segment ranges the engine used (``[start, end)``; None without segments).
    num_segment_tokens: int = 0
    segments: list[list[int]] | None = None
    # Presses: tokens whose KV a press dropped (the most over ``n`` children); 0 unpressed.
    num_pressed_tokens: int = 0
