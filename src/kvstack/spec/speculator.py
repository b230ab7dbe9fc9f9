"""``Speculator``: the engine's hooks for speculative decoding (plain Python, layer 1).

Life of one draft (``k = num_speculative_tokens``)::

    step t     sample token x   -> Speculator.after_step: propose d1..dk from prompt +
                                   output (ends in x); kept in Request.spec_token_ids
                                   (k per request: next_draft_len, after its last verify;
                                   none for a while after repeated misses: pause_after)
    step t+1   scheduler        -> rows [x d1 .. dk'] (k' <= k: cut to the budget and the
                                   request's room), slots for all of them allocated
               runner           -> logits of every row; model/sampling/rejection.py keeps
                                   d1..da and one token of its own (bonus / correction)
               scheduler        -> tokens appended one by one under the stop rules; the
                                   rejected slots rolled back (sched/scheduler.py)
               Speculator       -> counters (vLLM's spec_decode_*), the next proposal

Which requests speculate: vLLM's rule (``v1/spec_decode``: requests whose sampling
depends on the tokens before each row do not draft) extended to every such feature
here. A request with penalties (presence, frequency, repetition), ``min_tokens`` not
yet reached, ``bad_words``, structured outputs (grammar state per row) or ``logprobs``
decodes one token per step, exactly as without speculation: its output is the same,
only not faster. (Deviation: vLLM 0.32 returns logprobs of speculated tokens; here a
request asking for logprobs does not speculate.) ``allowed_token_ids``, ``logit_bias``,
temperature, top-k/p, min-p and seeds are the same for every row, so they speculate.

Engine-wide conflicts are one ``ConfigError`` at startup (``check_engine``); a request
that sets ``kv_press_every`` is a 400 (``check_request``): a press repeated while
decoding captures the queries of draft rows, and its compaction cannot be rolled back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.spec import build_proposer
from kvstack.spec.stats import SpecDecodeStats

if TYPE_CHECKING:
    from kvstack.core.request import Request, SamplingParams
    from kvstack.sched.output import ScheduledRequest
    from kvstack.spec.config import SpeculativeConfig


def build_speculator(
    spec: SpeculativeConfig | None,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_slots: int,
    kv_cache_dtype: str,
    codec_rolls_back: bool,
    kv_press_every: int | None,
) -> Speculator | None:
    """The engine's ``Speculator`` for ``spec`` (None: off), after
    ``Speculator.check_engine`` (the engine's step budget, context, KV slots and cache)."""
    if spec is None:
        return None
    Speculator.check_engine(
        spec, max_num_batched_tokens, max_model_len, num_slots,
        kv_cache_dtype, codec_rolls_back, kv_press_every,
    )  # fmt: skip
    return Speculator(spec)


def no_speculation_reason(req: Request) -> str | None:
    """Why ``req`` decodes without drafts now (None: it may speculate)."""
    sp = req.sampling_params
    if sp.logprobs is not None:
        return "logprobs"
    if sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0:
        return "penalties"
    if len(req.output_token_ids) < sp.min_tokens:
        return "min_tokens"
    if sp.bad_words_token_ids:
        return "bad_words"
    if sp.structured_outputs is not None:
        return "structured_outputs"
    return None


def next_draft_len(proposed: int, accepted: int, k: int) -> int:
    """The next draft's length after ``accepted`` of ``proposed`` drafts were kept: twice
    ``proposed`` (at most ``k``) when all were, else one more than were kept. Deviation
    from vLLM's n-gram proposer, which always asks for ``k``: a request whose drafts keep
    failing (prompt lookup matching spurious 2-grams in new text) verifies 2 rows a step
    instead of ``k + 1``, and one lucky match grows the next draft to 2, 4, 8 rows rather
    than straight back to ``k`` -- a verify of M rows costs more than M times nothing: the
    GGUF linears took 1.05x / 1.21x / 2.27x a one-row step's time at M = 2 / 4 / 9 (2-core
    AMD EPYC Zen 5), and on latency.py's open prompt prompt lookup keeps ~16 % of its
    drafts. Measured there (one process, 7 alternating runs, gguf, k 8): plain 1.0, jump
    to k 0.942x, doubling 0.967x; repetitive prompt 2.00x and 2.04x. The tokens are the
    same either way."""
    return min(k, 2 * proposed) if accepted == proposed else max(1, accepted + 1)


MAX_PAUSE = 8


def pause_after(misses: int, cap: int = MAX_PAUSE) -> int:
    """Steps a request decodes without proposing after ``misses`` consecutive verifies
    that kept no draft: none after the first, then 1, 2, 4, 8 (``MAX_PAUSE``) steps; one
    kept draft ends it. Deviation from vLLM (which proposes every step): on new text a
    prompt-lookup proposer keeps matching spurious n-grams, and each miss costs a
    proposal scan plus a verify row; the tokens are the same either way, and sampling
    stays exact (whether a step drafts depends only on earlier steps)."""
    return 0 if misses < 2 or cap <= 0 else min(cap, 2 ** (misses - 2))


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = build_proposer(config)
        self.stats = SpecDecodeStats(self.k)
        self.max_pause = MAX_PAUSE  # 0: propose every step, as vLLM (benchmarks/speculative.py)

    @staticmethod
    def check_engine(
        config: SpeculativeConfig,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_slots: int,
        codec: str,
        codec_rolls_back: bool,
        press_every: int | None,
    ) -> None:
        """One ``ConfigError`` for an engine that cannot verify ``k`` drafts: ``k + 1``
        rows must fit the step's budget, the context and the pool; the codec must allow
        rejected slots to be written again; no press may repeat while decoding."""
        k = config.num_speculative_tokens
        room = min(max_num_batched_tokens, max_model_len - 1, num_slots)
        if k + 1 > room:
            raise ConfigError(
                f"speculative_config: num_speculative_tokens={k} needs {k + 1} rows per step "
                f"but the cache's room is {room} (max_num_batched_tokens "
                f"{max_num_batched_tokens}, max_model_len - 1 = {max_model_len - 1}, "
                f"{num_slots} KV slots)"
            )
        if not codec_rolls_back:
            raise ConfigError(
                f"speculative_config cannot be combined with --kv-cache-dtype {codec}: the "
                "codec encodes a block once it fills and cannot roll back rejected tokens"
            )
        if press_every is not None:
            raise ConfigError(
                "speculative_config cannot be combined with --kv-press-every: a press "
                "repeated while decoding cannot roll back rejected draft tokens"
            )

    @staticmethod
    def check_request(sp: SamplingParams) -> None:
        """``InvalidRequestError`` (a 400) for a request this engine cannot speculate on."""
        if sp.kv_press_every is not None:
            raise InvalidRequestError(
                "kv_press_every cannot be combined with speculative decoding (this server "
                "runs with speculative_config): a press repeated while decoding cannot roll "
                "back rejected draft tokens",
                param="kv_press_every",
            )

    def after_step(
        self,
        scheduled: Iterable[ScheduledRequest],
        accepted: Mapping[str, list[int]],
        changed: Iterable[Request],
    ) -> None:
        """Count this step's verified drafts, then propose the next ones for every
        request that received tokens and still runs."""
        for s in scheduled:
            if s.draft_token_ids:
                n, a = len(s.draft_token_ids), len(accepted.get(s.request.request_id, ()))
                self.stats.observe_draft(n, a)
                req = s.request
                req.spec_draft_len = next_draft_len(n, a, self.k)
                req.spec_misses = 0 if a else req.spec_misses + 1
                req.spec_pause = pause_after(req.spec_misses, self.max_pause)
        t0 = time.perf_counter()
        n = 0
        for req in changed:
            if req.is_finished() or no_speculation_reason(req) is not None:
                req.spec_token_ids = []
                continue
            if req.spec_pause > 0:  # drafts kept failing: decode plainly for a while
                req.spec_pause -= 1
                req.spec_token_ids = []
                continue
            req.spec_token_ids = self.proposer.propose(
                req.all_token_ids, req.spec_draft_len or self.k
            )
            n += 1
        self.stats.propose_seconds += time.perf_counter() - t0
        self.stats.num_proposals += n
