"""``int4``: 4-bit, asymmetric, groups of 32 channels, bf16 scale + zero per group."""

from __future__ import annotations

from typing import ClassVar

import torch

from kvstack.core.errors import ConfigError
from kvstack.kv.codecs.bits import pack, quant_asym, unpack
from kvstack.kv.codecs.per_token import PerTokenCodec


class Int4Codec(PerTokenCodec):
    """4-bit, asymmetric, groups of ``GROUP`` channels (the common int4 KV scheme)."""

    name = "int4"
    code_dtype = torch.uint8
    GROUP: ClassVar[int] = 32
    BITS: ClassVar[int] = 4
    kernel_layout = "int4"

    @classmethod
    def check_head_dim(cls, head_dim: int) -> None:
        if head_dim % cls.GROUP:
            raise ConfigError(
                f"--kv-cache-dtype {cls.name} needs head_dim divisible by {cls.GROUP}, "
                f"got {head_dim}"
            )

    @classmethod
    def code_cols(cls, head_dim: int) -> int:
        return head_dim * cls.BITS // 8

    @classmethod
    def param_cols(cls, head_dim: int) -> int:
        return 2 * head_dim // cls.GROUP

    def kernel_group(self) -> int:
        return self.GROUP

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = x.float().unflatten(-1, (-1, self.GROUP))  # [..., groups, GROUP]
        q, sz = quant_asym(g, self.BITS, -1)  # sz [..., groups, 2]
        return pack(q.flatten(-2), self.BITS), sz.flatten(-2)

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        q = unpack(codes, self.BITS).float().unflatten(-1, (-1, self.GROUP))
        sz = params.float().unflatten(-1, (-1, 2))
        return (q * sz[..., :1] + sz[..., 1:]).flatten(-2)
