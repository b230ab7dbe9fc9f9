"""``QuantLinear``: ``y = x W^T`` with ``W`` a ``PackedWeight``, the path picked per call by M.

Decode (``M <= PREFILL_ROWS`` rows) is memory-bound; which op runs was measured on one
thread with ``benchmarks/quant_kernels.py`` (results/quant_kernels*.json):

- bf16 activations on a CPU with AVX512-VNNI: ``quant_gemv`` (``csrc/quant_gemv.cpp``)
  over a ``TiledWeight`` copy (``quant/tiled.py``: 16-row tiles, fp16 scales where
  exact), int8 activations as llama.cpp's. One layer at M = 1, two threads, hot caches
  (2-core AMD EPYC Zen 5, 2026-12-04): Q4_1 gate_up 3072x576 9 us vs 25 us for
  ``_weight_int4pack_mm_for_cpu``, ahead at every M = 1..128 (2.2-2.6x at M = 16); 30 layers'
  weights cycled from DRAM (a real token's case): 1.6-1.8 ms vs 2.5 ms. ``GEMV = False``
  (or ``int8_activations=False``) restores the choices below on such a CPU;
- bf16 activations, 4-bit groups (Q4_0, Q4_1, Q4_K, int4) and (without VNNI) int8:
  PyTorch's weight-only ops, as gpt-fast calls them (``TorchWeightOp``:
  ``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``): fastest at M = 1..16,
  ~2x kvstack's own kernel at M = 1. Their scales and zeros are bf16 (a deviation: the
  weights they multiply differ from the packed ones by <= 2^-9 of a group's scale/zero);
- 8-bit weights in bf16 (Q8_0, e.g. the default model's 57 MB lm_head, and int8 per
  channel) on a CPU with AVX512-VNNI: ``quant_linear_vnni`` (int8 activations x VNNI,
  llama.cpp's arithmetic for Q8_0), ``Q8_VNNI``. The default model's lm_head at M = 1,
  CPU time on one thread (AMD EPYC, 2026-12-02, shared machine): Q8_0 2.7 ms vs 4.6 ms
  for ``quant_linear``; int8 per channel 2.2 ms vs 5.0 ms for ``_weight_int8pack_mm``
  (the layers' shapes: equal within 10 %);
- on a CPU without AVX-512 (PyTorch's capability ``AVX2``, e.g. AMD Zen 3),
  ``quant_linear_vnni`` is the AVX2 kernel (vpmaddubsw, llama.cpp's AVX2 arithmetic) and
  every bf16 decode row takes it, 4-bit groups included (``int8_dot_is_avx2``): one
  layer at M = 1, one thread (AMD EPYC Zen 3, 2026-12-03, ``benchmarks/quant_kernels.py``,
  results/quant_kernels-2026-12-03-epyc-avx2.json): Q4_1 960x576 0.024 ms vs 0.071 for
  ``_weight_int4pack_mm_for_cpu``, int8 49152x576 1.34 vs 5.72 ms for
  ``_weight_int8pack_mm``; ahead of both at every M = 1..16;
- everything else (and every float32 model): ``torch.ops.kvstack.quant_linear``
  (``csrc/quant_linear.cpp``): the packed bytes read once, 32 weights at a time
  dequantized in registers, bit-identical to gguf-py's dequantization; float32 sums (so
  float32 runs generate the dequantized model's tokens). ``int8_activations=True`` sends
  4-bit weights to ``quant_linear_vnni`` too (a measured candidate; PyTorch's int4 op
  wins there).

Prefill (``M > PREFILL_ROWS``; ``M > GEMV_ROWS`` where ``quant_gemv`` runs) is
compute-bound: the weight is dequantized to the activation dtype (``quant_dequant``, a
[N, K] temporary) and multiplied by oneDNN (``F.linear``: AMX / AVX512-BF16 GEMM; on
AVX2-only CPUs a float32 GEMM of widened copies, ``layers.dense_linear``), which wins from
M ~ 16 on against the other decode ops (the crossover measured), but not against
``quant_gemv`` up to M = 128 (Zen 5, two threads, hot caches, Q4_1: gate_up 0.48 vs 0.58
ms, qkv 0.16 vs 0.21, down 0.26 vs 0.32 at M = 128; results/quant_kernels-*-m128.json).

Without the C++ extension (build failed, ``KVSTACK_NO_KERNELS``) the weight is dequantized
once at load into a plain ``Linear`` (the packed bytes are then not what is read),
counted as ``kvstack:kernel_fallback_total{kernel="quant_linear", reason="no_kernels"}``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstack.model.arch.layers import Linear, dense_linear
from kvstack.model.kernels import isa
from kvstack.model.kernels.loader import Kernels, direct, note_fallback
from kvstack.model.quant.packed import PackedWeight, dequantize_reference, unpack_u4
from kvstack.model.quant.tiled import TiledWeight, tiled_copy

PREFILL_ROWS = 16
GEMV_ROWS = 128  # quant_gemv's rows: it beat dequantize + oneDNN up to M = 128 (measured)
INT8_ACTIVATIONS = False
GEMV = True  # bf16 decode rows on AVX512-VNNI: quant_gemv over 16-row tiles
Q8_VNNI = True  # bf16 8-bit groups without a PyTorch op: quant_linear_vnni


def int8_dot_is_avx2() -> bool:
    """True where ``quant_linear_vnni`` is the AVX2 kernel: the ``avx2`` ISA level is
    loaded (``model/kernels/isa.py`` decides; the caller still asks ``quant_linear_vnni_ok``)."""
    return isa.int8_dot_is_avx2()


class TorchWeightOp:
    """PyTorch's CPU weight-only ops, as gpt-fast calls them (bf16 activations only):
    ``_weight_int4pack_mm_for_cpu`` for 4-bit groups (codes 0..15, ``w = (q - 8) scale +
    zero`` with ``zero = min + 8 scale``) and ``_weight_int8pack_mm`` for int8 per output
    channel. Deviation: their scales and zeros are bf16, so the weights they multiply are
    not bit-identical to the packed ones (relative error <= 2^-9 of each group's scale
    and zero); the float32 path (``quant_linear``) is."""

    def __init__(self, name: str, fn: Any) -> None:
        self.name = name
        self.fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def torch_weight_op(w: PackedWeight, dtype: torch.dtype) -> TorchWeightOp | None:
    """The PyTorch op for ``w`` at ``dtype``, or None (then ``quant_linear`` runs): bf16
    only, and only for shapes of whole tiles (``N % 32 == 0``, ``K % 64 == 0``; the model's
    are)."""
    n, k = w.out_features, w.in_features
    if dtype != torch.bfloat16 or n % 32 or k % 64:  # their CPU kernels' tiles (odd K crashes)
        return None
    if w.bits == 8 and w.group == w.in_features:
        q, s8 = w.q, w.scale.reshape(-1).to(dtype)
        return TorchWeightOp("torch_int8pack", lambda x: torch._weight_int8pack_mm(x, q, s8))
    if w.bits == 4 and w.min is not None and w.group in (32, 64, 128, 256):
        codes = unpack_u4(w.q).to(torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        zero = w.min + 8 * w.scale
        sz = torch.stack([w.scale.T, zero.T], dim=-1).contiguous().to(dtype)
        g = w.group
        return TorchWeightOp(
            "torch_int4pack", lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, g, sz)
        )
    return None


class QuantLinear:
    """A linear layer over a ``PackedWeight`` (``kernels``: ``torch.ops.kvstack`` or None)."""

    def __init__(
        self,
        weight: PackedWeight,
        dtype: torch.dtype,
        kernels: Kernels | None,
        prefill_rows: int | None = None,
        int8_activations: bool | None = None,
    ) -> None:
        if int8_activations is None:  # default: where the int8 dot product wins
            int8_activations = INT8_ACTIVATIONS or GEMV or int8_dot_is_avx2()
        self.packed = weight
        self.dtype = dtype
        self.out_features = weight.out_features
        self.k = kernels
        self.dense: Linear | None = None
        self.tiled: TiledWeight | None = None
        self.vnni = False
        if kernels is None:
            note_fallback("quant_linear", "no_kernels")
            self.dense = Linear(dequantize_reference(weight), dtype)
        elif dtype == torch.bfloat16:
            n, k, g, bits = weight.out_features, weight.in_features, weight.group, weight.bits
            if int8_activations and GEMV and kernels.quant_gemv_ok(n, k, g, bits):
                self.tiled = tiled_copy(weight)
            elif int8_activations or (Q8_VNNI and bits == 8):
                self.vnni = bool(kernels.quant_linear_vnni_ok(k, g, bits))
        if prefill_rows is None:  # more rows than this: dequantize + oneDNN
            prefill_rows = GEMV_ROWS if self.tiled is not None else PREFILL_ROWS
        self.prefill_rows = prefill_rows
        fast = self.dense is not None or self.vnni or self.tiled is not None
        self.torch_op = None if fast else torch_weight_op(weight, dtype)
        self._decode: Any = None  # the decode path, bound at first use (_decode_fn)

    @property
    def in_features(self) -> int:
        return self.packed.in_features

    @property
    def kernel(self) -> str:
        """What runs at decode: a PyTorch op's name, ``quant_gemv``, ``quant_linear_vnni``,
        ``quant_linear`` or the dense reference."""
        if self.dense is not None:
            return "dense_fallback"
        if self.torch_op is not None:
            return self.torch_op.name
        if self.tiled is not None:
            return "quant_gemv"
        return "quant_linear_vnni" if self.vnni else "quant_linear"

    @property
    def decode_bytes(self) -> int:
        """Weight bytes a decode call reads (the tiled copy's where ``quant_gemv`` runs)."""
        return self.tiled.nbytes if self.tiled is not None else self.packed.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W`` ``[N, K]`` in ``dtype`` (the kernel's weights, bit for bit)."""
        w = self.packed
        if self.k is None:
            return dequantize_reference(w, dtype)
        return self.k.quant_dequant(w.q, w.scale, w.min, w.group, w.bits, dtype)

    def _decode_fn(self) -> Any:
        """``x -> y`` for decode rows, bound once (one Python frame per call: a batch-1
        token runs ~120 of them)."""
        if self.torch_op is not None:
            return self.torch_op.fn
        k = self.k
        assert k is not None  # no kernels: self.dense
        if self.tiled is not None:
            t, gemv = self.tiled, direct(k.quant_gemv)
            codes, tscale, tmin, tgroup, tbits = t.codes, t.scale, t.min, t.group, t.bits
            return lambda x: gemv(x, codes, tscale, tmin, tgroup, tbits)
        op = direct(k.quant_linear_vnni if self.vnni else k.quant_linear)
        w = self.packed
        q, scale, mn, group, bits = w.q, w.scale, w.min, w.group, w.bits
        return lambda x: op(x, q, scale, mn, group, bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense(x)
        if x.shape[0] <= self.prefill_rows:
            if self._decode is None:
                self._decode = self._decode_fn()
            return self._decode(x)
        return dense_linear(x, self.dequantize(x.dtype))


class StackedLinear:
    """A fused linear (q/k/v, gate/up) whose parts cannot share one ``PackedWeight``: a
    4-bit run next to an 8-bit one (a Q4_K q/k with a Q6_K v), or packed parts next to a
    part of a GGUF type with no packed kernel (kept dense, ``Linear``). Each run of parts
    is its own linear, run one after another on the same input, their outputs
    concatenated along the features. Exact (every part keeps its bytes and kernel); the
    cost is one more call and a copy of the output columns, instead of dequantizing the
    whole matrix to the model dtype."""

    def __init__(self, parts: list[QuantLinear | Linear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        first = parts[0]
        self.in_features = (
            first.in_features if isinstance(first, QuantLinear) else int(first.weight.shape[1])
        )

    @property
    def kernel(self) -> str:
        return " + ".join(p.kernel if isinstance(p, QuantLinear) else "dense" for p in self.parts)

    @property
    def decode_bytes(self) -> int:
        return sum(
            p.decode_bytes if isinstance(p, QuantLinear) else p.weight.nbytes for p in self.parts
        )

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(
            [p.dequantize(dtype) if isinstance(p, QuantLinear) else p.weight.to(dtype)
             for p in self.parts]
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
