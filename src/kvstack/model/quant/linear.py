"""``QuantLinear``: ``y = x W^T`` with ``W`` a ``PackedWeight``, the path picked per call by M.

- ``M <= prefill_rows`` (decode, small batches): ``torch.ops.kvstack.quant_linear``
  (``csrc/quant_linear.cpp``): the packed bytes are read once and dequantized in
  registers; memory-bound, so ~4x fewer bytes than bf16 at 4 bits.
- ``M > prefill_rows`` (prefill chunks): the weight is dequantized to the activation
  dtype (``quant_dequant``, a [N, K] temporary) and multiplied by oneDNN (``F.linear``:
  AMX / AVX512-BF16 bf16 GEMM): compute-bound, where the GEMM library wins.
  ``PREFILL_ROWS`` is the crossover measured by ``benchmarks/quant_kernels.py``.

Both paths multiply the same weights (float32, or rounded to bf16 for bf16 activations),
so a row's result does not depend on how many rows share its step beyond float32
summation order. Without the C++ extension (build failed, ``KVSTACK_NO_KERNELS``) the
weight is dequantized once at load into a plain ``Linear`` (the reference path: the
packed bytes are then not what is read), counted as ``kvstack:kernel_fallback_total
{kernel="quant_linear", reason="no_kernels"}``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstack.model.kernels import Kernels, note_fallback
from kvstack.model.layers import Linear
from kvstack.model.quant.packed import PackedWeight, dequantize_reference

PREFILL_ROWS = 64
INT8_ACTIVATIONS = True


class QuantLinear:
    """A linear layer over a ``PackedWeight`` (``kernels``: ``torch.ops.kvstack`` or None)."""

    def __init__(
        self,
        weight: PackedWeight,
        dtype: torch.dtype,
        kernels: Kernels | None,
        prefill_rows: int = PREFILL_ROWS,
        int8_activations: bool = INT8_ACTIVATIONS,
    ) -> None:
        self.packed = weight
        self.dtype = dtype
        self.out_features = weight.out_features
        self.prefill_rows = prefill_rows
        self.k = kernels
        self.dense: Linear | None = None
        self.vnni = False
        if kernels is None:
            note_fallback("quant_linear", "no_kernels")
            self.dense = Linear(dequantize_reference(weight), dtype)
        elif int8_activations and dtype == torch.bfloat16:
            self.vnni = bool(
                kernels.quant_linear_vnni_ok(weight.in_features, weight.group, weight.bits)
            )

    @property
    def kernel(self) -> str:
        """What runs at decode: ``quant_linear_vnni``, ``quant_linear`` or the dense
        reference."""
        if self.dense is not None:
            return "dense_fallback"
        return "quant_linear_vnni" if self.vnni else "quant_linear"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W`` ``[N, K]`` in ``dtype`` (the kernel's weights, bit for bit)."""
        w = self.packed
        if self.k is None:
            return dequantize_reference(w, dtype)
        return self.k.quant_dequant(w.q, w.scale, w.min, w.group, w.bits, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x)
        w = self.packed
        if x.shape[0] <= self.prefill_rows:
            op = self.k.quant_linear_vnni if self.vnni else self.k.quant_linear
            return op(x, w.q, w.scale, w.min, w.group, w.bits)
        return F.linear(x, self.dequantize(x.dtype))
