"""The per-token ops of a Llama layer, two ways: PyTorch (the reference) and C++ (fused).

``TorchOps`` is the reference path, op for op what Hugging Face's Llama does (RMSNorm via
``F.rms_norm``, rotate-half RoPE with cos/sin cast to the activation dtype, SiLU then mul,
K/V written through ``KVStorage.write``). ``KernelOps`` does the same with one C++ pass
per row (``csrc/fused_ops.cpp``), as vLLM's CPU backend does with its ``rms_norm``,
``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` and ``reshape_and_cache``:

==================  ================================  ===========================
op                  PyTorch ops replaced (per layer)   exactness vs TorchOps
==================  ================================  ===========================
add_rms_norm        add, _fused_rms_norm (to, pow,     float32 sums in another
                    mean, add, rsqrt, mul, mul, to)    order: ~1 ulp
silu_and_mul        chunk, silu, mul                   own exp(): ~1 ulp
rope_and_cache      index, to, cat, neg, mul, mul,     bit-exact (rounds where
                    add, 2 x index_copy_, to           PyTorch rounds)
==================  ================================  ===========================

Invariant (both): a row's result depends only on that row, never on its batch mates, so
batched, chunked and prefix-cached runs agree with a plain run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvstack.kv.storage import LayerCache
from kvstack.model.arch.layers import Rotary, apply_rope, rms_norm
from kvstack.model.kernels.loader import Kernels, direct, note_fallback


@dataclass(frozen=True)
class HeadShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class RopeInput:
    """What RoPE needs for one step: positions ``[T]``, and either per-row cos/sin
    ``[T, 1, head_dim]`` (TorchOps) or the whole float32 tables (KernelOps)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class LayerOps(Protocol):
    """One implementation of the per-token ops (``TorchOps`` is the reference)."""

    name: str

    def rope_input(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> RopeInput:
        """Per-step RoPE inputs, computed once and shared by every layer."""
        ...

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (rounded to the dtype), then its RMSNorm: ``(normed, residual)``.
        Either input may be overwritten."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        rope: RopeInput,
        heads: HeadShape,
        cache: LayerCache,
        slots: torch.Tensor,
    ) -> QKV:
        """RoPE on the q and k heads of ``qkv`` ``[T, (H + 2 KVH) d]``, new K/V stored at
        ``slots`` of ``cache`` (one layer); returns q ``[T, H, d]``, k and v ``[T, KVH, d]``."""
        ...


def split_qkv(qkv: torch.Tensor, heads: HeadShape) -> QKV:
    """Views of q ``[T, H, d]``, k and v ``[T, KVH, d]`` (one view, three slices: this
    runs once per layer and step, so its Python cost counts at batch 1)."""
    h, kvh = heads.num_heads, heads.num_kv_heads
    rows = qkv.view(qkv.shape[0], h + 2 * kvh, heads.head_dim)
    return rows[:, :h], rows[:, h : h + kvh], rows[:, h + kvh :]


class TorchOps:
    """The reference path: PyTorch ops, as Hugging Face's Llama."""

    name = "torch"

    def rope_input(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> RopeInput:
        cos, sin = rotary.tables(positions, dtype)
        return RopeInput(positions, cos, sin)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, w, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        rope: RopeInput,
        heads: HeadShape,
        cache: LayerCache,
        slots: torch.Tensor,
    ) -> QKV:
        t, d = qkv.shape[0], heads.head_dim
        qk_heads = heads.num_heads + heads.num_kv_heads
        qk = qkv[:, : heads.q_size + heads.kv_size].view(t, qk_heads, d)
        qk = apply_rope(qk, rope.cos, rope.sin)  # q and k heads in one call
        q, k = qk[:, : heads.num_heads], qk[:, heads.num_heads :]
        v = split_qkv(qkv, heads)[2]
        cache.write(slots, k, v)
        return q, k, v


class KernelOps:
    """The fused C++ ops (``csrc/fused_ops.cpp``); RoPE rewrites ``qkv`` in place."""

    name = "kernels"

    def __init__(self, kernels: Kernels) -> None:
        self.k = kernels
        self._add_rms_norm = direct(kernels.add_rms_norm)
        self._silu_and_mul = direct(kernels.silu_and_mul)
        self._rope_and_cache = direct(kernels.rope_and_cache)

    def rope_input(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> RopeInput:
        return RopeInput(positions, rotary.cos, rotary.sin)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k.rms_norm(x.contiguous(), w, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.contiguous()
        self._add_rms_norm(x, residual, w, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(gate_up.contiguous())

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        rope: RopeInput,
        heads: HeadShape,
        cache: LayerCache,
        slots: torch.Tensor,
    ) -> QKV:
        raw = cache.k is not None and cache.v is not None and cache.k.dtype == qkv.dtype
        self._rope_and_cache(
            qkv, rope.positions, rope.cos, rope.sin,
            cache.k if raw else None, cache.v if raw else None,
            slots if raw else None,
            heads.num_heads, heads.num_kv_heads, heads.head_dim,
        )  # fmt: skip
        q, k, v = split_qkv(qkv, heads)
        if not raw:  # encoded (a KV codec) or cast cache: the codec stores the rows
            view = cache.per_token_view
            if view is not None:  # a per-token codec: encoded and stored in C++
                self.k.codec_write(
                    view.layout, view.group, k, v, slots, view.k_codes, view.v_codes,
                    view.k_params, view.v_params, view.rotation_signs,
                )  # fmt: skip
                return q, k, v
            if not cache.write(slots, k, v, self.k) and cache.layer == 0:
                note_fallback("kv_cache_write", "encoded_cache")
        return q, k, v


def select_ops(kernels: Kernels | None) -> LayerOps:
    """KernelOps when the extension is built, else the reference (the fallback is counted
    by ``load_kernels``)."""
    return KernelOps(kernels) if kernels is not None else TorchOps()
