"""Era 5: KV codecs — the block pool stores K and V compressed; attention reads them back.

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

import abc
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.errors import ConfigError


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


class KVCodec(abc.ABC):
    name: ClassVar[str]
    identity: bool = False  # stores the activation dtype unchanged (attention reads in place)

    def __init__(self, shape: CacheShape, dtype: torch.dtype, max_num_seqs: int = 0) -> None:
        self.check_head_dim(shape.head_dim)
        self.shape = shape
        self.dtype = dtype  # activation dtype that gather returns

    @classmethod
    def check_head_dim(cls, head_dim: int) -> None:
        """Raise ``ConfigError`` if the codec cannot encode heads of this size."""
        if head_dim <= 0:
            raise ConfigError(f"head_dim must be positive, got {head_dim}")

    @classmethod
    @abc.abstractmethod
    def bytes_per_token_head(cls, head_dim: int, block_size: int, act_itemsize: int) -> float:
        """K+V bytes per token, per KV head and layer, scales included."""

    @classmethod
    def fixed_bytes(cls, shape: CacheShape, max_num_seqs: int, act_itemsize: int) -> int:
        """Bytes the codec needs besides the blocks (KIVI's residual)."""
        return 0

    @abc.abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows ``k, v`` ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]``."""

    @abc.abstractmethod
    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of whole blocks."""

    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every block-indexed tensor, ``[num_layers, num_blocks, ...]``."""

    def on_block_freed(self, block_id: int) -> None:  # noqa: B027 - optional hook
        """A block went back to the free queue (its contents are dead)."""

    def check_integrity(self) -> None:
        """Assert the codec's own invariants (here: every tensor is block-indexed)."""
        s = self.shape
        for t in self.tensors():
            assert t.shape[:2] == (s.num_layers, s.num_blocks), f"bad codec tensor {t.shape}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


# ---------------------------------------------------------------------- identity
class IdentityCodec(KVCodec):
    """K/V stored unchanged in ``store_dtype`` (the activation dtype for ``auto``)."""

    name = "auto"
    store_dtype: torch.dtype | None = None

    def __init__(self, shape: CacheShape, dtype: torch.dtype, max_num_seqs: int = 0) -> None:
        super().__init__(shape, dtype, max_num_seqs)
        sd = self.store_dtype or dtype
        self.identity = sd == dtype
        s = shape
        full = (s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        self.k = torch.zeros(full, dtype=sd)
        self.v = torch.zeros(full, dtype=sd)
        self.k_slots = self.k.view(s.num_layers, -1, s.num_kv_heads, s.head_dim)
        self.v_slots = self.v.view(s.num_layers, -1, s.num_kv_heads, s.head_dim)

    @classmethod
    def bytes_per_token_head(cls, head_dim: int, block_size: int, act_itemsize: int) -> float:
        return 2 * head_dim * (cls.store_dtype.itemsize if cls.store_dtype else act_itemsize)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_slots[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v_slots[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][block_ids].to(self.dtype), self.v[layer][block_ids].to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class BF16Codec(IdentityCodec):
    name = "bf16"
    store_dtype = torch.bfloat16


# ---------------------------------------------------------------------- per-token codecs
class PerTokenCodec(KVCodec):
    """Each token's K and V rows are encoded alone: codes + per-row (or group) params."""

    code_dtype: ClassVar[torch.dtype]
    code_width: ClassVar[int]  # code elements per head_dim elements: d, d/2 ...
    num_params: ClassVar[int]  # bf16 parameters per row (per head) for K or V

    def __init__(self, shape: CacheShape, dtype: torch.dtype, max_num_seqs: int = 0) -> None:
        super().__init__(shape, dtype, max_num_seqs)
        s = shape
        rows = (s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads)
        cw, npar = self.code_cols(s.head_dim), self.param_cols(s.head_dim)
        self.k_codes = torch.zeros((*rows, cw), dtype=self.code_dtype)
        self.v_codes = torch.zeros((*rows, cw), dtype=self.code_dtype)
        self.k_params = torch.zeros((*rows, npar), dtype=torch.bfloat16)
        self.v_params = torch.zeros((*rows, npar), dtype=torch.bfloat16)

    @classmethod
    def code_cols(cls, head_dim: int) -> int:
        return head_dim

    @classmethod
    def param_cols(cls, head_dim: int) -> int:
        return 1

    @classmethod
    def code_bytes(cls) -> int:
        return torch.empty((), dtype=cls.code_dtype).element_size()

    @classmethod
    def bytes_per_token_head(cls, head_dim: int, block_size: int, act_itemsize: int) -> float:
        return 2 * (cls.code_cols(head_dim) * cls.code_bytes() + 2 * cls.param_cols(head_dim))

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[..., head_dim]`` -> (codes, bf16 params)."""

    @abc.abstractmethod
    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """Back to float32 rows ``[..., head_dim]``."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for x, codes, params in (
            (k, self.k_codes, self.k_params),
            (v, self.v_codes, self.v_params),
        ):
            c, p = self.encode(x)
            codes[layer].view(-1, *codes.shape[3:]).index_copy_(0, slots, c)
            params[layer].view(-1, *params.shape[3:]).index_copy_(0, slots, p)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.decode(self.k_codes[layer][block_ids], self.k_params[layer][block_ids])
        v = self.decode(self.v_codes[layer][block_ids], self.v_params[layer][block_ids])
        return k.to(self.dtype), v.to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.v_codes, self.k_params, self.v_params]


class FP8Codec(PerTokenCodec):
    """e4m3 codes (kept as their bytes: CPU ``index_copy_`` has no float8 kernel)."""

    name = "fp8"
    code_dtype = torch.uint8
    FP8_MAX = 448.0

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / self.FP8_MAX).clamp_min(1e-12)
        scale = scale.to(torch.bfloat16)
        codes = (xf / scale.float()).clamp(-self.FP8_MAX, self.FP8_MAX)
        return codes.to(torch.float8_e4m3fn).view(torch.uint8), scale

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).float() * params.float()


class Int8Codec(PerTokenCodec):
    name = "int8"
    code_dtype = torch.int8

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
        codes = torch.round(xf / scale.float()).clamp(-127, 127).to(torch.int8)
        return codes, scale

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        return codes.float() * params.float()


def _quant_asym(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization along ``dim``: (integer codes, [scale, zero] bf16)."""
    levels = (1 << bits) - 1
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(1e-12).to(torch.bfloat16)
    zero = lo.to(torch.bfloat16)
    q = torch.round((x - zero.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return q, torch.cat((scale, zero), dim)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``8 // bits`` codes of the last dim into each byte."""
    per = 8 // bits
    q = q.view(*q.shape[:-1], -1, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def _unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(p >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, -1).flatten(-2)


class Int4Codec(PerTokenCodec):
    """4-bit, asymmetric, groups of ``GROUP`` channels (the common int4 KV scheme)."""

    name = "int4"
    code_dtype = torch.uint8
    GROUP: ClassVar[int] = 32
    BITS: ClassVar[int] = 4

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

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = x.float().unflatten(-1, (-1, self.GROUP))  # [..., groups, GROUP]
        q, sz = _quant_asym(g, self.BITS, -1)  # sz [..., groups, 2]
        return _pack(q.flatten(-2), self.BITS), sz.flatten(-2)

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        q = _unpack(codes, self.BITS).float().unflatten(-1, (-1, self.GROUP))
        sz = params.float().unflatten(-1, (-1, 2))
        return (q * sz[..., :1] + sz[..., 1:]).flatten(-2)


def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order ``n`` (a power of two), normalized (orthogonal)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


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
        self.rot = signs[:, None] * hadamard(d)  # x_rot = x @ rot; x = x_rot @ rot.T

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, sz = _quant_asym(x.float() @ self.rot, self.BITS, -1)
        return _pack(q, self.BITS), sz

    def decode(self, codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        q = _unpack(codes, self.BITS).float()
        p = params.float()
        return (q * p[..., :1] + p[..., 1:]) @ self.rot.T


def codec_class(name: str) -> type[KVCodec]:
    """The codec registered as ``name`` (``--kv-cache-dtype``)."""
    from kvstack.kv.codec_kivi import Kivi2Codec

    codecs: dict[str, type[KVCodec]] = {
        c.name: c
        for c in (
            IdentityCodec,
            BF16Codec,
            FP8Codec,
            Int8Codec,
            Int4Codec,
            Kivi2Codec,
            Rotated4Codec,
        )
    }
    if name not in codecs:
        raise ConfigError(f"unknown --kv-cache-dtype {name!r}; choose one of: {', '.join(codecs)}")
    return codecs[name]


KV_CACHE_DTYPES = ("auto", "bf16", "fp8", "int8", "int4", "kivi2", "rotated4")
