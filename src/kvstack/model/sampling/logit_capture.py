"""LogitCapture: whole next-token distributions of prompt positions (``kvstack eval``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LogitCapture:
    """Next-token log-distributions of prompt positions ``>= start`` (fp16, ``[n, vocab]``).

    The row kept for prompt position ``p >= 1`` is the distribution the model gave the
    token at ``p`` from tokens ``0 .. p - 1`` (what ``prompt_logprobs`` scores).
    """

    start: int  # first prompt position to keep
    rows: list[torch.Tensor] = field(default_factory=list)

    def add(self, first: int, logits: torch.Tensor) -> None:
        """``logits[j]`` scores prompt position ``first + j``."""
        skip = max(0, self.start - first)
        if skip < logits.shape[0]:
            self.rows.append(torch.log_softmax(logits[skip:].float(), -1).to(torch.float16))

    def logprobs(self) -> torch.Tensor:
        return torch.cat(self.rows) if self.rows else torch.empty(0)
