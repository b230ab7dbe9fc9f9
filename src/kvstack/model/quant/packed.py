"""``PackedWeight``: one linear layer's weight kept quantized, and its reference dequantization.

Layout (the contract with ``csrc/quant_linear.cpp``): ``W`` is ``[N, K]`` (out, in); each
run of ``group`` consecutive weights of a row shares a float32 ``scale`` (and a float32
``min`` for 4 bits)::

    bits 8: q int8  [N, K]      scale [N, K/group]        W[n, k] = scale * q[n, k]
    bits 4: q uint8 [N, K/2]    scale, min [N, K/group]   W[n, k] = scale * q[n, k] + min

For 4 bits the 32 values ``k0..k0+31`` of a row (``k0 % 32 == 0``) are 16 bytes, byte ``j``
holding ``q[k0 + j]`` in its low and ``q[k0 + 16 + j]`` in its high nibble: llama.cpp's
``block_q4_0`` / ``block_q4_1`` order (ggml-common.h), so those GGUF bytes are used as they
are. ``group % 32 == 0`` for 4 bits.

Groups of 8-bit weights need not be whole 32-runs: Q6_K's are 16 (the kernels take
``group % 32 == 0`` or, 8 bits only, ``group == 16``).

Invariant: ``scale * q`` is exact in float32 for every weight kvstack packs (GGUF scales are
fp16, or fp16 times a 6-bit integer for Q4_K, or fp16 times an int8 for Q6_K: 11 + 7
significant bits, times a 6-bit code, fits float32's 24; ``quantize.py`` rounds its
scales to fp16 where the format has a min), so ``dequantize_reference`` (multiply, then add) and the
kernel's one fma give bit-identical weights, equal to gguf-py's float32 dequantization.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedWeight:
    """A quantized ``[out_features, in_features]`` weight (see the module docstring)."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    bits: int
    group: int
    source: str  # what it was packed from: a GGUF type ("Q4_1") or "int8" / "int4"

    def __post_init__(self) -> None:
        n = self.q.shape[0]
        k = self.in_features
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group <= 0 or k % self.group or (self.bits == 4 and self.group % 32):
            raise ValueError(f"group {self.group} does not fit {k} inputs at {self.bits} bits")
        if tuple(self.scale.shape) != (n, k // self.group):
            raise ValueError(f"scale shape {tuple(self.scale.shape)} != {(n, k // self.group)}")
        if (self.min is None) != (self.bits == 8):
            raise ValueError("a min is stored exactly for 4-bit weights")
        if self.min is not None and self.min.shape != self.scale.shape:
            raise ValueError("min and scale shapes differ")

    @property
    def out_features(self) -> int:
        return int(self.q.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.q.shape[1]) * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        """Bytes read per use: codes, scales and mins."""
        extra = 0 if self.min is None else self.min.numel() * 4
        return self.q.numel() + self.scale.numel() * 4 + extra

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """The weight with its rows reordered (``W[index]``), e.g. un-permuted q/k heads."""
        return PackedWeight(
            self.q[index].contiguous(),
            self.scale[index].contiguous(),
            None if self.min is None else self.min[index].contiguous(),
            self.bits,
            self.group,
            self.source,
        )


def regroup(w: PackedWeight, group: int) -> PackedWeight:
    """``w`` with its scales (and mins) repeated to groups of ``group`` (dividing
    ``w.group``): the same weights, bit for bit; the codes are shared."""
    if group == w.group:
        return w
    if w.group % group:
        raise ValueError(f"group {group} does not divide {w.group}")
    reps = w.group // group
    mn = None if w.min is None else w.min.repeat_interleave(reps, dim=1).contiguous()
    scale = w.scale.repeat_interleave(reps, dim=1).contiguous()
    return PackedWeight(w.q, scale, mn, w.bits, group, w.source)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight | None:
    """The parts stacked along ``out_features`` (fused qkv, gate_up), or None when their
    bit widths differ (a 4-bit part cannot join an 8-bit one without changing its
    bytes). Parts of one width but other groups (Q5_0 / Q8_0 groups of 32 with Q6_K's
    16) share the smallest group, their scales repeated (``regroup``: exact); the
    source names every format joined (``"Q5_0+Q8_0"``)."""
    first = parts[0]
    if any(p.bits != first.bits for p in parts):
        return None
    group = math.gcd(*(p.group for p in parts))
    if first.bits == 4 and group % 32:
        return None
    parts = [regroup(p, group) for p in parts]
    mins = [p.min for p in parts]
    return PackedWeight(
        torch.cat([p.q for p in parts]).contiguous(),
        torch.cat([p.scale for p in parts]).contiguous(),
        None if first.min is None else torch.cat([m for m in mins if m is not None]).contiguous(),
        first.bits,
        group,
        "+".join(dict.fromkeys(p.source for p in parts)),
    )


def pack_u4(values: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` integers 0..15 -> ``[N, K/2]`` uint8 in the 32-value nibble order."""
    n, k = values.shape
    v = values.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_u4(q: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_u4``: ``[N, K/2]`` uint8 -> ``[N, K]`` uint8 values 0..15."""
    n, half = q.shape
    b = q.reshape(n, half // 16, 1, 16)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(n, 2 * half)


def dequantize_reference(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W`` as a dense ``[N, K]`` tensor, with PyTorch ops (the kernels' reference):
    ``scale * q (+ min)`` in float32, then rounded once to ``dtype``."""
    codes = unpack_u4(w.q) if w.bits == 4 else w.q
    n, k = codes.shape
    grouped = codes.to(torch.float32).reshape(n, k // w.group, w.group)
    out = grouped * w.scale.unsqueeze(-1)
    if w.min is not None:
        out = out + w.min.unsqueeze(-1)
    return out.reshape(n, k).to(dtype)


class DenseOrPacked(Mapping[str, torch.Tensor]):
    """A model's float32 weights where those kept packed are not expanded at load.

    ``dense`` holds the weights read as floats; a name found only in ``packed`` is
    dequantized when asked for (``dequantize_reference``: bit-identical to gguf-py's float32
    values), which happens only where a linear falls back to a dense layer. Loading a GGUF
    this way reads each packed tensor once, as bytes, instead of expanding it to float32
    and then packing it again (``model/loader/registry.load_model``)."""

    def __init__(self, dense: Mapping[str, torch.Tensor], packed: Mapping[str, PackedWeight]):
        self.dense = dense
        self.packed = packed

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.dense:
            return self.dense[name]
        return dequantize_reference(self.packed[name])

    def __contains__(self, name: object) -> bool:  # Mapping's would dequantize to answer
        return name in self.dense or name in self.packed

    def __iter__(self) -> Iterator[str]:
        yield from self.dense
        yield from (n for n in self.packed if n not in self.dense)

    def __len__(self) -> int:
        return len(self.dense) + sum(1 for n in self.packed if n not in self.dense)

    def shape(self, name: str) -> tuple[int, ...]:
        """The weight's shape, without dequantizing it."""
        if name in self.dense:
            return tuple(self.dense[name].shape)
        w = self.packed[name]
        return (w.out_features, w.in_features)
