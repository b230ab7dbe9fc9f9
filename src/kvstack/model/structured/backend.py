"""The grammar-backend extension point: compile a constraint, match tokens, fill masks.

A backend turns a ``StructuredOutputsParams`` into a compiled grammar once (the manager
caches it by ``params.key()``), then makes one matcher per request from it. Each step the
manager asks the backend to fill a packed bitmask for the batch's constrained rows::

    bitmask  int32 [rows, ceil(V / 32)]    bit t % 32 of word t // 32 set = token t allowed

and after sampling feeds each row's token to its matcher. Invariants: a matcher has
consumed exactly the request's output tokens (``accept`` is called once per sampled
token, in order); a mask never allows a token its matcher would reject; a terminated
matcher allows only EOS.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvstack.core.structured_outputs import StructuredOutputsParams


class GrammarMatcher(Protocol):
    """The state of one request's output in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (error state)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding)."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar can take nothing but EOS (or is in an error state)."""
        ...

    def error(self) -> str | None:
        """Why the matcher entered its error state, if it did."""
        ...


class CompiledGrammar(Protocol):
    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer; fills masks for batches of matchers."""

    def __init__(self, vocab_json: str, vocab_size: int, eos_token_ids: list[int]) -> None: ...

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile (validated) ``params``; ``InvalidRequestError`` with ``param`` if the
        schema, regex or grammar is invalid or uses an unsupported feature."""
        ...

    def fill_bitmask(self, rows: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Write the allowed tokens of each ``(matcher, row)`` into ``bitmask[row]``."""
        ...
