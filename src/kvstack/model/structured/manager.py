"""StructuredOutputManager: compiled grammars (cached), one matcher per request, masks.

As vLLM v1's ``StructuredOutputManager``: the engine compiles a request's constraint when
the request is added (an invalid one is rejected before anything is queued), the runner
asks for the bitmask of the rows it samples, applies it inside the vectorized sampler
and feeds each sampled token back::

    add_request ─► compile(params) (cache by params.key()) ─► add(child_id, grammar)
    each step   ─► bitmask_for(requests) ─► Sampler(mask) ─► accept(rid, token)
    finished    ─► release(ids)     (engine.step: requests that finished, aborts, failed steps)

Invariants (``check_integrity``): a matcher exists only for a live request and has
consumed exactly that request's output tokens. Preemption keeps the output tokens (the
scheduler recomputes their KV), so matchers carry over untouched; the bitmask depends
only on the request's own tokens, never on its batch mates.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvstack.core.request import Request
from kvstack.core.structured_outputs import StructuredOutputsParams
from kvstack.model.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from kvstack.model.structured.backends import STRUCTURED_BACKENDS
from kvstack.model.structured.bitmask import StepMask, allocate_bitmask
from kvstack.model.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


@dataclass
class _Tracked:
    matcher: GrammarMatcher
    num_accepted: int = 0


class StructuredOutputManager:
    """Grammar state of every constrained request of one engine (engine thread only)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend_name = "llguidance" if backend == "auto" else backend
        STRUCTURED_BACKENDS.get(self.backend_name)  # ConfigError for an unknown name
        self._backend: GrammarBackend | None = None  # built on first use (~0.4 s)
        self._cache: OrderedDict[tuple[str, str, bool, str | None], CompiledGrammar] = OrderedDict()
        self._requests: dict[str, _Tracked] = {}
        self.num_compiled = 0
        self.num_cache_hits = 0

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            t0 = time.perf_counter()
            cls = STRUCTURED_BACKENDS.get(self.backend_name)
            eos = sorted(self.tokenizer.eos_token_ids)
            self._backend = cls(self.tokenizer.backend.to_str(), self.vocab_size, eos)
            logger.info(
                "structured outputs: %s ready in %.2f s", self.backend_name,
                time.perf_counter() - t0,
            )  # fmt: skip
        return self._backend

    # ------------------------------------------------------------------ requests
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params`` (validated by ``SamplingParams.validate``);
        ``InvalidRequestError`` if the backend cannot compile it."""
        key = params.key()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.num_cache_hits += 1
            return hit
        grammar = self.backend.compile(params)
        self.num_compiled += 1
        self._cache[key] = grammar
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar

    def add(self, request_id: str, grammar: CompiledGrammar) -> None:
        self._requests[request_id] = _Tracked(grammar.new_matcher())

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ steps
    def bitmask_for(self, requests: list[Request]) -> StepMask | None:
        """The mask of the constrained rows among ``requests`` (batch order); None if none."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._requests]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(rows), self.vocab_size)
        pairs = [(self._requests[requests[i].request_id].matcher, j) for j, i in enumerate(rows)]
        self.backend.fill_bitmask(pairs, bitmask)
        return StepMask(torch.tensor(rows, dtype=torch.int64), bitmask)

    def accept(self, request_id: str, token: int) -> str | None:
        """Feed a sampled token to the request's matcher (if it has one).

        Returns None while the output may continue, ``"done"`` once the grammar is
        complete (the request should stop), or an error message if the token was rejected.
        """
        tracked = self._requests.get(request_id)
        if tracked is None:
            return None
        ok = tracked.matcher.accept(token)
        tracked.num_accepted += 1
        if not ok:
            return tracked.matcher.error() or f"token {token} does not match the grammar"
        return "done" if tracked.matcher.is_terminated() else None

    def rewind(self, request_id: str, num_accepted: int) -> None:
        """Undo the tokens the request's matcher accepted after its first ``num_accepted``
        (a failed step's attempt is run again: ``step_isolation.py``)."""
        tracked = self._requests.get(request_id)
        if tracked is not None and tracked.num_accepted > num_accepted:
            tracked.matcher.rollback(tracked.num_accepted - num_accepted)
            tracked.num_accepted = num_accepted

    def check_integrity(self, live: dict[str, Request], finishing: Iterable[str] = ()) -> None:
        """Every matcher belongs to a live (or just finished) request and has consumed
        exactly its output tokens."""
        pending = set(finishing)
        for rid, tracked in self._requests.items():
            req = live.get(rid)
            if req is None:
                assert rid in pending, f"grammar state of {rid} outlives the request"
                continue
            n = len(req.output_token_ids)
            assert tracked.num_accepted == n, (
                f"{rid}: grammar consumed {tracked.num_accepted} tokens, output has {n}"
            )
