"""``rotated4``: a fixed randomized Hadamard rotation (QuaRot; TurboQuant's rotate-then-quantize
idea), then 4-bit with one scale + zero per head vector; rotated back on read."""

from __future__ import annotations

import dataclasses
import math

import torch

from kvstack.core.errors import ConfigError
from kvstack.kv.codecs.base import CacheShape, KernelView
from kvstack.kv.codecs.bits import pack, quant_asym, unpack
from kvstack.kv.codecs.int4 import Int4Codec


def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), normalized (orthogonal)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def rotate_rows(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x R`` for float32 rows ``[..., n]``, ``R = diag(signs) H / sqrt(n)``, as a fast
    Walsh-Hadamard transform: the signs, then log2(n) butterfly stages (``a + b``, ``a - b``
    over pairs ``h`` apart), then the norm. The same float32 operations in the same order
    as the C++ ``rotate()`` (``model/kernels/csrc/codec_rows.h``), so the C++ KV write
    (``codec_write.cpp``) stores the same codes as this reference, bit for bit; equal to
    ``x @ (signs[:, None] * hadamard(n))`` up to float32 rounding."""
    return butterflies(x * signs) * _norm(x.shape[-1])


def unrotate_rows(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``y R^T`` (the inverse of ``rotate_rows``, ``R`` orthogonal): butterflies, then the
    norm times the signs, as the C++ ``rotate(..., inverse=true)`` does."""
    return butterflies(y) * (_norm(y.shape[-1]) * signs)


def _norm(n: int) -> torch.Tensor:
    """``1 / sqrt(n)`` in float32, each step rounded as C++'s ``1.f / std::sqrt(float(n))``."""
    return torch.tensor(float(n)).sqrt().reciprocal()


def butterflies(x: torch.Tensor) -> torch.Tensor:
    """``x H`` (Sylvester's Hadamard matrix, unnormalized) for float32 rows ``[..., n]``:
    log2(n) stages of ``a + b``, ``a - b`` over pairs ``h`` apart, in codec_rows.h fwht()'s
    order."""
    n = x.shape[-1]
    h = 1
    while h < n:
        pairs = x.unflatten(-1, (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), -2).flatten(-3)
        h *= 2
    return x


class Rotated4Codec(Int4Codec):
    """Randomized Hadamard rotation, then 4-bit with one scale+zero per head vector.

    The rotation ``R = diag(signs) @ H`` (fixed seed) spreads outlier channels over all
    channels, so one range per vector loses less than it would unrotated (QuaRot; the
    rotate-then-scalar-quantize idea of TurboQuant, with a uniform quantizer here).
    """

    name = "rotated4"

    @classmethod
    def check_head_dim(cls, head_dim: int) -> None:
        if head_dim < 2 or head_dim & (head_dim - 1):
            raise ConfigError(
                "--kv-cache-dtype rotated4 needs a power-of-two head_dim (Hadamard), "
                f"got {head_dim}"
            )

    @classmethod
    def param_cols(cls, head_dim: int) -> int:
        return 2

    def __init__(self, shape: CacheShape, dtype: torch.dtype, max_num_seqs: int = 0) -> None:
        super().__init__(shape, dtype, max_num_seqs)
        d = shape.head_dim
        gen = torch.Generator().manual_seed(0x5EED)
        signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
        self.signs = signs
        self.rot = signs[:, None] * hadamard(d)  # x_rot = x @ rot; x = x_rot @ rot.T

    def kernel_group(self) -> int:
        return 0  # one (scale, zero) pair per head vector

    def build_kernel_view(self, layer: int) -> KernelView | None:
        """The int4 layout with one group per head, in the rotated basis: the kernel scores
        ``q @ rot`` against the codes and rotates its output back (orthogonal ``rot``)."""
        view = super().build_kernel_view(layer)
        return None if view is None else dataclasses.replace(view, rotation_signs=self.signs)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, sz = quant_asym(rotate_rows(x.float(), self.signs), self.BITS, -1)
        return pack(q, self.BITS), sz

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        q = unpack(codes, self.BITS).float()
        p = params.float()
        return unrotate_rows(q * p[..., :1] + p[..., 1:], self.signs)
