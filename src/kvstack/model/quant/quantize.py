"""Quantizing float weights at load (``--quantization int8`` / ``int4``), as gpt-fast does.

- ``int8``: per output channel, symmetric: ``scale = max|W[n]| / 127``, ``q = round(W /
  scale)`` in ``[-127, 127]`` (gpt-fast's ``WeightOnlyInt8QuantHandler``; it divides by
  127.5 over ``[-128, 127]``: kvstack keeps the code range symmetric).
- ``int4``: group-wise, asymmetric, groups of ``INT4_GROUP`` = 32 weights along the input:
  ``scale = (max - min) / 15``, ``min``, ``q = round((W - min) / scale)`` in ``[0, 15]``:
  llama.cpp's Q4_1 formula. gpt-fast (``WeightOnlyInt4QuantHandler``, group 32..256)
  stores ``(scale, zero = min + 8 scale)`` in bf16; kvstack rounds scale and min to fp16
  (as Q4_1), which keeps ``scale * q`` exact in float32 (``packed.py``'s invariant), and
  picks the codes against the rounded scale and min.

A constant group gets ``scale`` 0 and reproduces its value through ``min``.
"""

from __future__ import annotations

import torch

from kvstack.model.quant.packed import PackedWeight, pack_u4

INT4_GROUP = 32
_FP16_MAX = 65504.0


def quantize_int8(w: torch.Tensor) -> PackedWeight:
    """``w`` ``[N, K]`` (any float dtype) -> int8 per output channel (group = K)."""
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe).clamp_(-127, 127).to(torch.int8)
    return PackedWeight(q.contiguous(), scale.contiguous(), None, 8, w.shape[1], "int8")


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).to(torch.float32)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> PackedWeight:
    """``w`` ``[N, K]`` -> 4-bit groups of ``group`` with fp16-valued scale and min;
    ``ValueError`` when ``K`` is not a multiple of ``group`` (a multiple of 32)."""
    n, k = w.shape
    if group % 32 or k % group:
        raise ValueError(f"int4 needs in_features ({k}) divisible by the group ({group})")
    g = w.to(torch.float32).reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    mn = _fp16(lo)
    scale = _fp16((hi - mn).clamp_min(0) / 15.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - mn.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return PackedWeight(
        pack_u4(q.reshape(n, k)), scale.contiguous(), mn.contiguous(), 4, group, "int4"
    )
