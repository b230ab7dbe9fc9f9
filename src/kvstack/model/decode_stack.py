"""DecodeStack: every decoder layer of a step in one C++ call (``csrc/decode_stack.cpp``).

One request decoding with quantized weights (issue 16) runs ~120 ``quant_gemv`` calls
and ~250 small ops a token; with a GGUF token at ~3.5 ms, the Python frames and
dispatches between them (~1-2 us each) were ~0.5 ms of it. ``decode_stack`` runs the
same kernels, in the same order, on the same tensors as ``LlamaModel``'s loop, from one
C++ function, so its results are the Python loop's bit for bit (tested).

It takes a step when (``usable``) every linear of every layer is a tiled ``QuantLinear``
(``--quantization`` gguf / int8 / int4 in bf16 on an AVX512-VNNI CPU) that runs
``quant_gemv`` at this row count, the family adds nothing to q/k/v (no QKV bias, no q/k
norm: Llama, Mistral), the KV cache is unencoded, and every row goes to the C++ paged
attention (``AttentionMetadata.kernel_rows``: decodes, speculative verifies and short
chunks) with no press capturing queries and one KV group. Otherwise the Python loop runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstack.model.kernels import Kernels, load_kernels
from kvstack.model.quant.linear import QuantLinear

if TYPE_CHECKING:
    from kvstack.kv.storage import KVStorage
    from kvstack.model.attention import AttentionMetadata
    from kvstack.model.llama import LlamaModel
    from kvstack.model.ops import HeadShape, RopeInput

ENABLED = True  # False: always the Python loop (tests compare the two)
LINEARS = ("qkv", "o", "gate_up", "down")


@dataclass
class DecodeStack:
    kernels: Kernels
    in_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    codes: list[torch.Tensor]  # 4 per layer: qkv, o, gate_up, down (tiled)
    scales: list[torch.Tensor]
    mins: list[torch.Tensor | None]
    groups: list[int]
    bits: list[int]
    windows: list[int]  # 0: every key
    max_rows: int  # more rows: some linear leaves quant_gemv
    dtype: torch.dtype
    _caches: tuple[object, list[torch.Tensor], list[torch.Tensor]] | None = None

    @staticmethod
    def build(model: LlamaModel) -> DecodeStack | None:
        """The stack of ``model``, or None when its layers cannot run in one call."""
        cfg = model.config
        k = load_kernels()
        if not ENABLED or k is None or model.ops.name != "kernels":
            return None
        if not hasattr(k, "decode_stack"):
            return None
        if cfg.qkv_bias or cfg.qk_norm:
            return None
        lins = [getattr(layer, n) for layer in model.layers for n in LINEARS]
        tiled = [lin.tiled for lin in lins if isinstance(lin, QuantLinear)]
        if len(tiled) != len(lins) or any(t is None for t in tiled):
            return None
        ts = [t for t in tiled if t is not None]
        return DecodeStack(
            kernels=k,
            in_norms=[layer.input_norm for layer in model.layers],
            post_norms=[layer.post_norm for layer in model.layers],
            codes=[t.codes for t in ts], scales=[t.scale for t in ts], mins=[t.min for t in ts],
            groups=[t.group for t in ts], bits=[t.bits for t in ts],
            windows=[w or 0 for w in model.windows],
            max_rows=min(lin.prefill_rows for lin in lins if isinstance(lin, QuantLinear)),
            dtype=model.dtype,
        )  # fmt: skip

    def usable(self, rows: int, meta: AttentionMetadata, kv: KVStorage) -> bool:
        """True when this step's rows can run in one call (see the module docstring)."""
        kr = meta.kernel_rows
        if kr is None or kr.num_rows != rows or meta.prefills or rows > self.max_rows:
            return False
        if meta.groups is not None or meta.capture_rows or not ENABLED:
            return False
        return self._kv(kv) is not None

    def _kv(self, kv: KVStorage) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Every layer's raw K and V cache (None: encoded, or another dtype)."""
        first = kv.layer(0)
        if self._caches is not None and self._caches[0] is first.k:
            return self._caches[1], self._caches[2]
        caches = [kv.layer(i) for i in range(len(self.in_norms))]
        if any(c.k is None or c.v is None or c.k.dtype != self.dtype for c in caches):
            return None
        ks = [c.k for c in caches if c.k is not None]
        vs = [c.v for c in caches if c.v is not None]
        self._caches = (first.k, ks, vs)
        return ks, vs

    def run(
        self,
        residual: torch.Tensor,
        rope: RopeInput,
        meta: AttentionMetadata,
        kv: KVStorage,
        heads: HeadShape,
        scale: float,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)`` after the last layer: its MLP output and the residual stream
        without it, as the Python loop leaves them."""
        caches = self._kv(kv)
        kr = meta.kernel_rows
        assert caches is not None and kr is not None  # usable() was True
        h, res = self.kernels.decode_stack(
            residual, self.in_norms, self.post_norms, self.codes, self.scales, self.mins,
            self.groups, self.bits, rope.positions, rope.cos, rope.sin, caches[0], caches[1],
            meta.slot_mapping, kr.block_tables, kr.table_index, kr.context_lens, scale,
            self.windows, heads.num_heads, heads.num_kv_heads, heads.head_dim, eps,
        )  # fmt: skip
        return h, res
