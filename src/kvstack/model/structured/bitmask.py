"""Packed token bitmasks: allocation and application to a batch of logits.

``bitmask[r, w]`` (int32) holds tokens ``32 w .. 32 w + 31`` of row r, bit ``t % 32`` for
token t (the layout llguidance and xgrammar write). A vocabulary of V tokens needs
``ceil(V / 32)`` words; bits past V are ignored. Applying a mask sets every disallowed
logit to -inf: ``apply_bitmask`` is the PyTorch reference (one vectorized pass that
unpacks a bool mask), ``csrc/token_mask.cpp`` the kernel ``StepMask.apply`` uses (it
skips all-allowed words and never builds the ``[R, V]`` mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.model.kernels.loader import load_kernels

_BITS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed mask (every bit set) for ``rows`` rows."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[rows, vocab_size]``: True where the mask allows the token."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set (in place) ``logits[rows[i], t]`` to -inf where ``bitmask[i]`` disallows t."""
    allowed = allowed_tokens(bitmask, logits.shape[1])
    # The logits come out of the forward pass as inference tensors; writing into one is
    # allowed only in inference mode (the sampler runs outside it).
    with torch.inference_mode():
        sub = logits[rows]
        sub.masked_fill_(~allowed, float("-inf"))
        logits[rows] = sub


@dataclass
class StepMask:
    """The mask of one sampling step: ``bitmask[i]`` constrains batch row ``rows[i]``."""

    rows: torch.Tensor  # int64 [R]
    bitmask: torch.Tensor  # int32 [R, ceil(V / 32)]

    def apply(self, logits: torch.Tensor) -> None:
        """The mask on ``logits`` (in place): the C++ kernel when built, else PyTorch."""
        kernels = load_kernels()
        if kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            kernels.apply_token_bitmask(logits, self.rows, self.bitmask)
        else:
            apply_bitmask(logits, self.rows, self.bitmask)
