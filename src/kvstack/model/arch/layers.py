"""Small building blocks of the Llama forward: linear layers, RMSNorm, RoPE.

``Linear`` keeps bf16 weights prepacked for oneDNN when the CPU supports it (measured on a
2-core AMD EPYC: 0.14 ms vs 0.27 ms for a decode-size GEMM); float32 uses plain ``F.linear`` so fp32
results stay bit-comparable with the reference. A bf16 weight that cannot be prepacked
runs through ``F.linear`` and is counted (``kvstack:kernel_fallback_total{kernel=
"onednn_prepack"}``). On a CPU with AMX, AVX512-BF16, AVX-512F or AVX2 + FMA, decode-sized
bf16 inputs (decode batches, short chunks) go to kvstack's own kernel instead
(``model/kernels/packed_linear.py``: AMX tiles, ``VDPBF16PS`` or widening FMAs), which streams the
weights where oneDNN is compute-starved (the chosen kernel's ``use`` decides per input).
Without native bf16 in oneDNN: on AVX-512F CPUs every bf16 input goes to the widening
kernel; on AVX2-only CPUs longer inputs run as a float32 GEMM of widened copies
(``packed_linear.widened_linear``), ~7x faster there than PyTorch's bf16 matmul.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvstack.core import hugepages
from kvstack.core.model_config import RopeScaling
from kvstack.model.kernels import amx_linear, isa, packed_linear
from kvstack.model.kernels.loader import note_fallback


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` for a weight that is not a ``Linear`` (a dequantized prefill weight); in
    bf16 on a CPU without native oneDNN bf16 (AVX2-only, AVX-512 without BF16), the float32
    GEMM of widened copies, 3-7x faster there than PyTorch's bf16 matmul
    (``packed_linear.widened_linear``)."""
    if x.dtype != torch.bfloat16 or isa.onednn_bf16():
        return F.linear(x, weight)
    return packed_linear.widened_linear(x, weight)


# oneDNN's prepacked linear, its C++ callable bound once (the packet's __call__ is a
# Python frame; a batch-1 token runs ~120 linears).
_LINEAR_POINTWISE = getattr(
    torch.ops.mkldnn._linear_pointwise, "_op", torch.ops.mkldnn._linear_pointwise
)


class Linear:
    """``y = x @ W.T`` with ``W`` ``[out, in]``; prepacked for oneDNN in bf16."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, prepack: bool = True) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.out_features = self.weight.shape[0]
        self.packed: torch.Tensor | None = None
        self.tiles: torch.Tensor | None = None  # the packed copy of packed_linear's kernel
        self._tile: packed_linear.TileKernel | None = None
        if not (prepack and dtype == torch.bfloat16):
            return
        if amx_linear.packable(self.weight) and (kern := packed_linear.tile_kernel()) is not None:
            self.tiles = hugepages.weight_copy(amx_linear.pack_weight(self.weight))
            self._tile = kern
        if not isa.onednn_bf16():  # counted: kvstack:kernel_fallback_total
            note_fallback("onednn_prepack", "bf16_unsupported")
            return
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        except RuntimeError:
            note_fallback("onednn_prepack", "reorder_failed")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._tile is not None and self._tile.use(x, self.out_features):
            return self._tile.op(x, self.tiles, self.out_features)  # type: ignore[arg-type]
        if self.packed is not None:
            return _LINEAR_POINTWISE(x, self.packed, None, "none", [], "")
        if self._tile is not None:  # a kernel build but no oneDNN bf16 (AVX2-only CPUs)
            return packed_linear.widened_linear(x, self.weight)
        return F.linear(x, self.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) via PyTorch's fused kernel.

    Equal to Hugging Face's LlamaRMSNorm in float32; in bfloat16 it rounds once at the
    end instead of twice (about 2x faster than the unfused form at prefill sizes).
    """
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of RoPE (Su et al., 2021), with optional llama3-style scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv.float()
    if scaling.rope_type not in ("llama3",):
        raise ValueError(f"unsupported rope scaling type {scaling.rope_type!r}")
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled).float()


class Rotary:
    """Precomputed cos/sin tables ``[max_pos, head_dim]`` (rotate-half layout, as HF)."""

    def __init__(
        self, head_dim: int, max_pos: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin rows for ``positions`` shaped ``[T, 1, head_dim]``, computed once a step."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
