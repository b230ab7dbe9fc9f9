"""``fp8``: e4m3 per token and head, bf16 scale = amax / 448.

vLLM's FP8 KV cache uses per-tensor scales; per-row scales here lose less.
"""

from __future__ import annotations

import torch

from kvstack.kv.codecs.per_token import PerTokenCodec


class FP8Codec(PerTokenCodec):
    """e4m3 codes (kept as their bytes: CPU ``index_copy_`` has no float8 kernel)."""

    name = "fp8"
    code_dtype = torch.uint8
    FP8_MAX = 448.0
    kernel_layout = "fp8_e4m3"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / self.FP8_MAX).clamp_min(1e-12)
        scale = scale.to(torch.bfloat16)
        codes = (xf / scale.float()).clamp(-self.FP8_MAX, self.FP8_MAX)
        return codes.to(torch.float8_e4m3fn).view(torch.uint8), scale

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).float() * params.float()


class FP8E5M2Codec(FP8Codec):
    """vLLM's ``fp8_e5m2``: e5m2 codes (2 mantissa bits, range 57344), scale = amax / 57344.

    Wider range, coarser steps than e4m3: with a per-row scale the range is never
    needed, so e4m3 (``fp8``) loses less; e5m2 is here so a vLLM command line runs.
    """

    name = "fp8_e5m2"
    FP8_MAX = 57344.0
    kernel_layout = "fp8_e5m2"

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / self.FP8_MAX).clamp_min(1e-12)
        scale = scale.to(torch.bfloat16)
        codes = (xf / scale.float()).clamp(-self.FP8_MAX, self.FP8_MAX)
        return codes.to(torch.float8_e5m2).view(torch.uint8), scale

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e5m2).float() * params.float()
