"""KV codecs — the block pool stores K and V compressed; attention reads them back.

Every codec keeps one layer's cache as block-major tensors ``[num_blocks, block_size,
kv_heads, ...]`` (so a block is a slice, as the offload tiers need) and offers

* ``write(layer, slots, k, v)``: quantize new rows ``[T, kv_heads, head_dim]`` into ``slots``;
* ``gather(layer, block_ids)``: dequantize whole blocks to the activation dtype,
  ``block_ids.shape + (block_size, kv_heads, head_dim)``.

With a codec other than the identity, attention reads *every* K/V through the codec, the
current chunk's own included (write, then read back), so a teacher-forced prompt sees
exactly what later decode steps see.

=========  ==================================================  =========================
name       scheme                                               bytes / token / head (d=64)
=========  ==================================================  =========================
auto       activation dtype, no codec                           256 (bf16 K+V)
bf16       bfloat16 storage (a codec only for float32 models)   256
fp8        e4m3 per token and head, bf16 scale = amax / 448     2 x (64 + 2) = 132
           (vLLM's FP8 KV cache uses per-tensor scales)
int8       symmetric per token and head, bf16 scale             132
int4       asymmetric, groups of 32 channels, bf16 scale+zero   2 x (32 + 8) = 80
kivi2      KIVI (Liu et al., ICML 2024): keys 2-bit per channel  2 x 16 codes + 16 (key
           over each block's tokens, values 2-bit per token      scale/zero per channel,
           (groups of 32 channels); the newest, unfilled block   amortized) + 8 = 56, plus
           stays bf16 until it fills (residual)                  one bf16 block per sequence
rotated4   a fixed randomized Hadamard rotation (QuaRot, Ashk-  2 x (32 + 4) = 72
           boos et al. 2024; TurboQuant's idea of rotating
           before scalar quantization), then 4-bit with one
           scale+zero per head vector; rotated back on read
=========  ==================================================  =========================

Error bounds (checked by the tests, per element): fp8 <= 2^-4 of the row's |amax| (3
mantissa bits); int8 <= 1/254 of |amax|; int4 <= 1/30 of the group's range; kivi2 <= 1/6
of the group's range (keys: the channel's range over the block); rotated4 <= 1/30 of the
rotated vector's range, in the rotated basis (the rotation is orthogonal, so the L2 error
is the same after rotating back). Parameters are stored in bf16 and codes are computed
with the rounded parameters, which adds at most 2^-8 of the largest |value| to the
asymmetric codecs' bounds (the rounding of the zero point).
"""

from __future__ import annotations

from kvstack.core.registry import Registry
from kvstack.kv.codecs.base import CacheShape, KernelView, KVCodec
from kvstack.kv.codecs.bf16 import BF16Codec
from kvstack.kv.codecs.fp8 import FP8Codec, FP8E5M2Codec
from kvstack.kv.codecs.identity import IdentityCodec
from kvstack.kv.codecs.int4 import Int4Codec
from kvstack.kv.codecs.int8 import Int8Codec
from kvstack.kv.codecs.kivi import Kivi2Codec
from kvstack.kv.codecs.per_token import PerTokenCodec
from kvstack.kv.codecs.rotated4 import Rotated4Codec, hadamard

CODECS: Registry[type[KVCodec]] = Registry("--kv-cache-dtype")
CODECS.add("auto", IdentityCodec, "the model dtype (default)")
CODECS.add("bf16", BF16Codec, "bfloat16 storage for float32 models")
CODECS.add("fp8", FP8Codec, "e4m3 per token and head (1.94x the tokens of bf16)")
CODECS.add("fp8_e5m2", FP8E5M2Codec, "e5m2 per token and head (vLLM's fp8_e5m2; fp8 loses less)")
CODECS.add("int8", Int8Codec, "symmetric per token and head (1.94x)")
CODECS.add("int4", Int4Codec, "groups of 32 channels (3.2x)")
CODECS.add(
    "kivi2",
    Kivi2Codec,
    "KIVI 2-bit, keys per channel, values per token, the filling block kept in bf16 (4.6x)",
)
CODECS.add("rotated4", Rotated4Codec, "randomized Hadamard rotation then 4-bit (3.6x)")
KV_CACHE_DTYPES = CODECS.names()


def codec_class(name: str) -> type[KVCodec]:
    """The codec registered as ``name`` (``--kv-cache-dtype``); ``ConfigError`` if none."""
    return CODECS.get(name)


__all__ = [
    "CODECS",
    "KV_CACHE_DTYPES",
    "BF16Codec",
    "CacheShape",
    "FP8Codec",
    "IdentityCodec",
    "Int4Codec",
    "Int8Codec",
    "KVCodec",
    "KernelView",
    "Kivi2Codec",
    "PerTokenCodec",
    "Rotated4Codec",
    "codec_class",
    "hadamard",
]
