"""Integer quantization helpers shared by the int4, rotated4 and KIVI codecs."""

from __future__ import annotations

import torch


def quant_asym(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization along ``dim``: (integer codes, [scale, zero] bf16)."""
    levels = (1 << bits) - 1
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(1e-12).to(torch.bfloat16)
    zero = lo.to(torch.bfloat16)
    q = torch.round((x - zero.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return q, torch.cat((scale, zero), dim)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``8 // bits`` codes of the last dim into each byte."""
    per = 8 // bits
    q = q.view(*q.shape[:-1], -1, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(p >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, -1).flatten(-2)
