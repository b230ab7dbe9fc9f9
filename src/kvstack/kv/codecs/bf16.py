"""``bf16``: bfloat16 storage, a codec only for float32 models."""

from __future__ import annotations

import torch

from kvstack.kv.codecs.identity import IdentityCodec


class BF16Codec(IdentityCodec):
    name = "bf16"
    store_dtype = torch.bfloat16
