"""``TiledWeight``: a ``PackedWeight`` repacked into 16-row tiles for ``quant_gemv``.

``csrc/quant_gemv.cpp`` multiplies decode-sized inputs (M <= ~16 rows) by 4- or 8-bit
weights with AVX512-VNNI: one ``vpdpbusd`` takes 64 codes -- 4 consecutive inputs of 16
output rows -- against 4 int8 activations broadcast to every lane, so the 16 rows' sums
stay in the 16 lanes of one register and need no horizontal reduction. The weight is
reordered once at load so those 64 bytes are contiguous (tile ``t`` = rows
``16t .. 16t+15``, chunk ``c`` = inputs ``32c .. 32c+31``)::

    bits 8: tile t, chunk c: 8 vectors v of [16 rows x 4 bytes]
            byte (v, j, b) = q[16t + j, 32c + 4v + b] + 128      (unsigned for vpdpbusd)
    bits 4: tile t, chunk c: 4 vectors v of [16 rows x 4 bytes]
            low nibble  of (v, j, b) = q[16t + j, 32c + 8v + b]
            high nibble of (v, j, b) = q[16t + j, 32c + 8v + 4 + b]

    scale, min: [N/16, K/group, 16] -- the 16 rows of a tile's group side by side

Scales (and mins) are stored as float16 when every value is exactly a float16 -- GGUF's
Q4_0 / Q4_1 / Q8_0 scales are, and ``quantize.py`` rounds int4's to fp16 -- halving the
bytes they add per token (a Q4_1 weight's fp32 scale and min are 2 of its 6 bits); float32
otherwise (Q4_K's fp16 x 6-bit products, int8's per-channel scales). The weights the
kernel multiplies are exactly ``dequantize_reference``'s; the activations are int8 per
32-chunk, as ``quant_linear_vnni`` and llama.cpp quantize them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.core import hugepages
from kvstack.model.quant.packed import PackedWeight, unpack_u4

TILE = 16


@dataclass(frozen=True)
class TiledWeight:
    """A ``PackedWeight`` in ``quant_gemv``'s tile layout (module docstring)."""

    codes: torch.Tensor  # uint8 [N/16, K * bits / 8 * 16]
    scale: torch.Tensor  # float16 or float32 [N/16, K/group, 16]
    min: torch.Tensor | None  # as scale, 4 bits only
    bits: int
    group: int

    @property
    def nbytes(self) -> int:
        """Bytes read per use: codes, scales and mins."""
        mins = 0 if self.min is None else self.min.numel() * self.min.element_size()
        return self.codes.numel() + self.scale.numel() * self.scale.element_size() + mins


def _exact_half(*tensors: torch.Tensor | None) -> bool:
    """Whether every value of every tensor is a float16 (finite, no rounding)."""
    for t in tensors:
        if t is not None and not torch.equal(t.to(torch.float16).to(t.dtype), t):
            return False
    return True


def _tile_params(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, groups = p.shape
    return p.reshape(n // TILE, TILE, groups).transpose(1, 2).contiguous().to(dtype)


def tile_codes(w: PackedWeight) -> torch.Tensor:
    """The codes of ``w`` in tile order (module docstring), uint8 ``[N/16, K*bits/8*16]``."""
    n, k = w.out_features, w.in_features
    if w.bits == 8:
        u8 = (w.q.to(torch.int16) + 128).to(torch.uint8)  # [N, K]
        t = u8.reshape(n // TILE, TILE, k // 4, 4).transpose(1, 2)  # [T, K/4, 16, 4]
        return t.reshape(n // TILE, k * TILE).contiguous()
    vals = unpack_u4(w.q).reshape(n // TILE, TILE, k // 8, 2, 4)  # [T, j, v, half, b]
    nib = vals.permute(0, 2, 1, 4, 3)  # [T, v, j, b, half]
    packed = nib[..., 0] | (nib[..., 1] << 4)  # [T, K/8, 16, 4]
    return packed.reshape(n // TILE, k // 2 * TILE).contiguous()


def tile_weight(w: PackedWeight) -> TiledWeight:
    """``w`` repacked for ``quant_gemv`` (``w.out_features % 16 == 0``, ``in_features %
    32 == 0``: ``quant_gemv_ok`` says whether it applies)."""
    if w.out_features % TILE or w.in_features % 32:
        raise ValueError(f"{w.out_features}x{w.in_features} is not whole 16 x 32 tiles")
    dtype = torch.float16 if _exact_half(w.scale, w.min) else torch.float32
    mn = None if w.min is None else _tile_params(w.min, dtype)
    return TiledWeight(tile_codes(w), _tile_params(w.scale, dtype), mn, w.bits, w.group)


def tiled_copy(w: PackedWeight) -> TiledWeight:
    """``tile_weight(w)`` with its tensors in the weight arena on huge pages (a decode token
    streams every weight once: ``kvstack/core/hugepages.py``)."""
    t = tile_weight(w)
    mn = None if t.min is None else hugepages.weight_copy(t.min)
    codes, scale = hugepages.weight_copy(t.codes), hugepages.weight_copy(t.scale)
    return TiledWeight(codes, scale, mn, t.bits, t.group)
