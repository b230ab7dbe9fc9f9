"""The scheduler's decision for one step: the contract between scheduler and runner.

Everything here is plain Python (no torch). The runner turns it into tensors.

For each scheduled request the step computes KV for tokens
``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` of
``request.all_token_ids``::

    all_token_ids:  t0 t1 t2 ... t(c-1) | tc ... t(c+n-1) | (not yet)
                    <-- in the cache --> <-- this step --->
    positions:                             c ... c+n-1
    slot of position p: block_ids[p // block_size] * block_size + p % block_size

The request samples a token this step iff ``c + n == request.num_tokens``.

Speculative decoding (``spec/``): a decoding request may carry ``draft_token_ids``, the
proposer's guesses, as extra rows after its last token. They count in ``n`` (and in the
step's token budget) and get KV slots, but are not in ``all_token_ids``::

    all_token_ids:  t0 ... t(N-2) | t(N-1) | d1 d2 d3        (N = num_tokens, 3 drafts)
                    <- in cache -> <------ this step ------>
    positions:                      N-1      N  N+1 N+2
    logits row j predicts position N + j: row 0 checks d1, ..., row 3 is the bonus

The request then samples (``samples``) when ``c + n == num_tokens + len(draft)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstack.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # snapshot taken when scheduled (the request's field moves on)
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table (covers computed + new tokens)
    # Speculative decoding: the last num_new_tokens rows' inputs are these guesses.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence, so a token is sampled."""
        end = self.request.num_tokens + len(self.draft_token_ids)
        return self.num_computed_tokens + self.num_new_tokens == end


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests finished (aborted, stopped, rejected) since the previous step.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
