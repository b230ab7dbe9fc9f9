"""Weight quantization schemes (``--quantization``) and the builder of a model's linears.

A scheme decides, per weight, whether it is kept packed (``PackedWeight``, multiplied by
``QuantLinear``) or dense in the model dtype (``Linear``, oneDNN):

====  ===================================================================================
none  every linear dense (bf16 / float32): the reference
int8  every linear quantized at load, int8 per output channel (``quantize.py``)
int4  every linear quantized at load, 4-bit groups of 32 with fp16 scale and min
gguf  the GGUF file's own Q8_0 / Q4_0 / Q4_1 / Q4_K bytes kept as they are, Q5_0 and Q6_K
      as exact 8-bit codes (5 / 6 bits widened to 8: ``gguf_blocks.py``; a GGUF only)
====  ===================================================================================

"Every linear" is the fused q/k/v, o, fused gate/up and down of each layer, and the
lm_head (for tied embeddings, the embedding matrix: ~57 MB of the ~270 MB a bf16 token
reads). What stays in the model dtype, and why:

- the embedding table for the token lookup: one row per token is read, so quantizing it
  saves memory, not time (a tied model holds it twice: dense for lookups, packed as
  lm_head);
- RMSNorm weights and RoPE tables: 576-value vectors, read once per token;
- under ``gguf``, a tensor whose GGUF type has no packed kernel (F32, F16, BF16, Q5_1,
  Q2_K, Q3_K, Q5_K): dequantized, with one warning naming the type (``load``);
- under ``int4``, a weight whose ``in_features`` is not a multiple of 32.

A fused matrix whose parts differ in format stays packed: parts of one bit width join
(``concat_rows``: Q5_0 q/k with a Q8_0 v; scales repeated to a common group), and a 4-bit
run next to an 8-bit one (Q4_K q/k, Q6_K v) is a ``StackedLinear`` of one packed linear
each (``fusable_runs``); a part with no packed kernel beside packed ones is dense alone.

The builder logs, once per model, how many linears took which path.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from itertools import groupby
from typing import Protocol

import torch

from kvstack.core.registry import Registry
from kvstack.model.arch.layers import Linear
from kvstack.model.kernels.loader import Kernels
from kvstack.model.quant.linear import QuantLinear, StackedLinear
from kvstack.model.quant.packed import PackedWeight, concat_rows
from kvstack.model.quant.quantize import INT4_GROUP, quantize_int4, quantize_int8

logger = logging.getLogger("kvstack.quant")


class LinearOp(Protocol):
    """A linear layer: ``y = x W^T`` for ``x`` ``[M, in_features]``."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class WeightScheme(Protocol):
    """One ``--quantization`` choice: the packed form of weight ``name``, or None (dense).
    ``weights`` maps names to float32 weights; a scheme reads it only if it needs the
    floats (``gguf`` does not: its weights may not have been expanded at all)."""

    def pack(self, name: str, weights: Mapping[str, torch.Tensor]) -> PackedWeight | None: ...


class SchemeFactory(Protocol):
    def __call__(self, packed: Mapping[str, PackedWeight]) -> WeightScheme: ...


QUANTIZATIONS: Registry[SchemeFactory] = Registry("quantization")


@QUANTIZATIONS.register("none", help="weights in the model dtype (default)")
class NoQuantization:
    def __init__(self, packed: Mapping[str, PackedWeight]) -> None:
        del packed

    def pack(self, name: str, weights: Mapping[str, torch.Tensor]) -> PackedWeight | None:
        return None


@QUANTIZATIONS.register("int8", help="int8 per output channel, quantized at load")
class Int8:
    def __init__(self, packed: Mapping[str, PackedWeight]) -> None:
        del packed

    def pack(self, name: str, weights: Mapping[str, torch.Tensor]) -> PackedWeight | None:
        return quantize_int8(weights[name])


@QUANTIZATIONS.register("int4", help=f"4-bit groups of {INT4_GROUP}, quantized at load")
class Int4:
    def __init__(self, packed: Mapping[str, PackedWeight]) -> None:
        del packed

    def pack(self, name: str, weights: Mapping[str, torch.Tensor]) -> PackedWeight | None:
        weight = weights[name]
        if weight.shape[1] % INT4_GROUP:
            return None
        return quantize_int4(weight)


@QUANTIZATIONS.register("gguf", help="a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_0/Q6_K weights kept packed")
class GGUFPacked:
    def __init__(self, packed: Mapping[str, PackedWeight]) -> None:
        self.packed = packed

    def pack(self, name: str, weights: Mapping[str, torch.Tensor]) -> PackedWeight | None:
        return self.packed.get(name)


def fusable_runs(parts: list[PackedWeight]) -> list[PackedWeight]:
    """``parts`` (in row order) joined into as few ``PackedWeight`` s as ``concat_rows``
    allows: consecutive parts of one bit width become one (Q5_0 q/k with a Q8_0 v, Q4_K
    with Q6_K needs two: 4-bit q/k, 8-bit v)."""
    runs: list[PackedWeight] = [parts[0]]
    for p in parts[1:]:
        joined = concat_rows([runs[-1], p])
        if joined is None:
            runs.append(p)
        else:
            runs[-1] = joined
    return runs


class LinearBuilder:
    """Builds a model's linear layers under one scheme; ``summary`` says what it chose."""

    def __init__(
        self,
        quantization: str,
        dtype: torch.dtype,
        packed: Mapping[str, PackedWeight] | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        self.quantization = quantization
        self.scheme = QUANTIZATIONS.get(quantization)(packed or {})
        self.dtype = dtype
        self.kernels = kernels
        self.paths: Counter[str] = Counter()

    def build(self, names: list[str], weights: Mapping[str, torch.Tensor]) -> LinearOp:
        """The linear of the weights ``names`` stacked along the output (fused q/k/v).
        Packed parts stay packed even beside a part that is not (a GGUF type with no
        packed kernel): that part alone is dense, and the whole a ``StackedLinear``."""
        parts = [self.scheme.pack(n, weights) for n in names]
        if all(p is None for p in parts):
            plain = self.quantization == "none"
            self.paths[self._dense_path(plain)] += 1
            return Linear(self._stacked(names, weights), self.dtype)
        ops: list[QuantLinear | Linear] = []
        for is_packed, group in groupby(zip(names, parts, strict=True), lambda t: t[1] is not None):
            run = list(group)
            if not is_packed:
                self.paths[self._dense_path(False)] += 1
                ops.append(Linear(self._stacked([n for n, _ in run], weights), self.dtype))
                continue
            for fused in fusable_runs([p for _, p in run if p is not None]):
                linear = QuantLinear(fused, self.dtype, self.kernels)
                self.paths[f"{fused.source} {fused.bits}-bit -> {linear.kernel}"] += 1
                ops.append(linear)
        return ops[0] if len(ops) == 1 else StackedLinear(ops)

    def _dense_path(self, plain: bool) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"dense {dtype}" if plain else f"dense {dtype} (not packed)"

    @staticmethod
    def _stacked(names: list[str], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([weights[n] for n in names]) if len(names) > 1 else weights[names[0]]

    def summary(self) -> str:
        return ", ".join(f"{n} x {path}" for path, n in self.paths.items())

    def log(self) -> None:
        logger.info("linear layers (--quantization %s): %s", self.quantization, self.summary())
