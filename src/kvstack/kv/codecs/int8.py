"""``int8``: symmetric per token and head, bf16 scale = amax / 127."""

from __future__ import annotations

import torch

from kvstack.kv.codecs.per_token import PerTokenCodec


class Int8Codec(PerTokenCodec):
    name = "int8"
    code_dtype = torch.int8
    kernel_layout = "int8"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
        codes = torch.round(xf / scale.float()).clamp(-127, 127).to(torch.int8)
        return codes, scale

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return codes.float() * params.float()
