"""DecodeStack: every decoder layer of a step in one C++ call (``csrc/decode_stack.cpp``).

One request decoding with quantized weights (GGUF, int8, int4) runs ~120 ``quant_gemv`` calls
and ~250 small ops a token; with a GGUF token at ~3.5 ms, the Python frames and
dispatches between them (~1-2 us each) were ~0.5 ms of it. ``decode_stack`` runs the
same kernels, in the same order, on the same tensors as ``LlamaModel``'s loop, from one
C++ function, so its results are the Python loop's bit for bit (tested).

It takes a step when (``usable``) every linear of every layer runs one of kvstack's own
kernels at this row count — a tiled ``QuantLinear`` (``--quantization`` gguf / int8 /
int4 in bf16 on an AVX512-VNNI CPU: ``quant_gemv``) or a bf16 ``Linear`` whose packed
copy goes to ``bf16_linear`` / ``amx_linear`` (``model/kernels/packed_linear.py``'s rule by rows;
beyond it oneDNN runs and so does the Python loop) — the family adds nothing to q/k/v (no
QKV bias, no q/k norm: Llama, Mistral), the KV cache is unencoded (for ``decode_team``, or
a per-token codec's, below), and every row goes to
the C++ paged attention (``AttentionMetadata.kernel_rows``: decodes, speculative verifies
and short chunks) with no press capturing queries and one KV group.

Where ``decode_team_supported`` says so (bf16, head_dim 64, 1-8 q heads per KV head, every
linear a ``quant_gemv`` or ``bf16_linear`` weight, an AVX-512 build), the same step runs as
``decode_team`` (``csrc/decode_team.cpp``): one parallel region for all layers, the
threads meeting at barriers between a layer's phases instead of each kernel opening its
own region, allocating its output and re-checking its inputs — bit for bit
``decode_stack``'s results (tested); 1.07-1.09x a token on the 2-core Zen 5. The team
also takes a cache of the per-token KV codecs (int8, fp8, int4, rotated4: the codec's
write and its C++ attention as phases of the region, ``csrc/team_codec.h``), bit for bit
the Python loop's ``codec_write`` and ``paged_attention_codec``; ``decode_stack`` itself
takes unencoded caches only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvstack.core.model_config import ModelConfig
from kvstack.model.arch.layers import Linear
from kvstack.model.arch.weights import LayerWeights
from kvstack.model.kernels.loader import Kernels, load_kernels
from kvstack.model.quant.linear import QuantLinear

if TYPE_CHECKING:
    from kvstack.kv.storage import KVStorage
    from kvstack.model.arch.ops import HeadShape, RopeInput
    from kvstack.model.attention import AttentionMetadata

ENABLED = True  # False: always the Python loop (tests compare the two)
TEAM = True  # False: decode_stack even where decode_team could run (tests compare them)
LINEARS = ("qkv", "o", "gate_up", "down")
QUANT_GEMV, BF16_LINEAR, AMX_LINEAR = 0, 1, 2  # csrc/decode_stack.cpp's kinds


@dataclass
class StackLinear:
    """One linear as ``decode_stack`` takes it, and the row counts it runs there."""

    kind: int
    codes: torch.Tensor  # tiled codes, or the packed bf16 weight
    scale: torch.Tensor
    min: torch.Tensor | None
    group: int  # the out_features of a bf16 kind
    bits: int
    takes: Callable[[int], bool]  # rows -> whether the Python path runs this kernel too


def stack_linear(lin: object) -> StackLinear | None:
    """``lin`` as ``decode_stack`` runs it, or None (PyTorch / oneDNN would run it)."""
    if isinstance(lin, QuantLinear) and lin.tiled is not None and lin.dense is None:
        t, limit = lin.tiled, lin.prefill_rows
        return StackLinear(QUANT_GEMV, t.codes, t.scale, t.min, t.group, t.bits,
                           lambda rows: rows <= limit)  # fmt: skip
    if isinstance(lin, Linear) and lin.tiles is not None and lin._tile is not None:
        tile, w = lin._tile, lin.weight
        kind = AMX_LINEAR if tile.name == "amx" else BF16_LINEAR

        def takes(rows: int) -> bool:  # the Python path's own rule (Linear.__call__)
            return tile.use(torch.empty(rows, w.shape[1], dtype=w.dtype), lin.out_features)

        return StackLinear(kind, lin.tiles, lin.tiles, None, lin.out_features, 0, takes)
    return None


@dataclass
class StackCaches:
    """Every layer's KV storage as the stack takes it: the raw K/V caches (``codec`` empty),
    or a per-token codec's codes and parameters (``KernelView``), decode_team only."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    codec: str = ""
    group: int = 0
    k_params: list[torch.Tensor] = field(default_factory=list)
    v_params: list[torch.Tensor] = field(default_factory=list)
    signs: torch.Tensor | None = None


@dataclass
class DecodeStack:
    kernels: Kernels
    in_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    linears: list[StackLinear]  # 4 per layer: qkv, o, gate_up, down
    windows: list[int]  # 0: every key
    dtype: torch.dtype
    team: bool = False  # decode_team takes these layers (csrc/decode_team.cpp)
    heads: tuple[int, int, int] = (0, 0, 0)  # q heads, KV heads, head_dim
    _rows_ok: dict[int, bool] = field(default_factory=dict)
    _caches: tuple[object, StackCaches | None] | None = None
    _args: tuple[list[Any], ...] = ()  # the linears' columns, as decode_stack takes them

    def __post_init__(self) -> None:
        ls = self.linears
        self._args = (
            [x.codes for x in ls], [x.scale for x in ls], [x.min for x in ls],
            [x.group for x in ls], [x.bits for x in ls], [x.kind for x in ls],
        )  # fmt: skip

    @staticmethod
    def build(
        cfg: ModelConfig,
        layers: Sequence[LayerWeights],
        windows: Sequence[int | None],
        dtype: torch.dtype,
        ops_name: str,
    ) -> DecodeStack | None:
        """The stack of a model's ``layers`` (run by the ``ops_name`` ops, each layer's
        sliding window in ``windows``), or None when they cannot run in one call."""
        k = load_kernels()
        if not ENABLED or k is None or ops_name != "kernels":
            return None
        if not hasattr(k, "decode_stack") or cfg.qkv_bias or cfg.qk_norm:
            return None
        lins = [stack_linear(getattr(layer, n)) for layer in layers for n in LINEARS]
        if any(lin is None for lin in lins):
            return None
        kinds = [lin.kind for lin in lins if lin is not None]
        team = (
            dtype == torch.bfloat16
            and hasattr(k, "decode_team")
            and bool(k.decode_team_supported(kinds, cfg.num_heads, cfg.num_kv_heads,
                                             cfg.head_dim))
        )  # fmt: skip
        return DecodeStack(
            kernels=k,
            in_norms=[layer.input_norm for layer in layers],
            post_norms=[layer.post_norm for layer in layers],
            linears=[lin for lin in lins if lin is not None],
            windows=[w or 0 for w in windows],
            dtype=dtype,
            team=team,
            heads=(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
        )

    def takes(self, rows: int) -> bool:
        """Whether every linear runs its stack kernel at ``rows`` rows (cached)."""
        ok = self._rows_ok.get(rows)
        if ok is None:
            ok = self._rows_ok[rows] = all(lin.takes(rows) for lin in self.linears)
        return ok

    def usable(self, rows: int, meta: AttentionMetadata, kv: KVStorage) -> bool:
        """True when this step's rows can run in one call (see the module docstring)."""
        kr = meta.kernel_rows
        if kr is None or kr.num_rows != rows or meta.prefills or not self.takes(rows):
            return False
        if meta.groups is not None or meta.capture_rows or not ENABLED:
            return False
        return self._kv(kv) is not None

    def _kv(self, kv: KVStorage) -> StackCaches | None:
        """Every layer's storage as the stack takes it (None: another dtype, or a codec the
        team cannot take, or the team is off), cached per storage."""
        first = kv.layer(0)
        key = first.k if first.k is not None else first.codec
        if self._caches is None or self._caches[0] is not key:
            self._caches = (key, self._storage(kv))
        caches = self._caches[1]
        if caches is not None and caches.codec and not (self.team and TEAM):
            return None
        return caches

    def _storage(self, kv: KVStorage) -> StackCaches | None:
        caches = [kv.layer(i) for i in range(len(self.in_norms))]
        if all(c.k is not None and c.v is not None and c.k.dtype == self.dtype for c in caches):
            return StackCaches([c.k for c in caches if c.k is not None],
                               [c.v for c in caches if c.v is not None])  # fmt: skip
        views = [c.per_token_view for c in caches]
        if not self.team or any(v is None for v in views):
            return None
        vs = [v for v in views if v is not None]
        kinds = [lin.kind for lin in self.linears]
        if not self.kernels.decode_team_supported(kinds, *self.heads, vs[0].layout, vs[0].group):
            return None
        return StackCaches(
            [v.k_codes for v in vs], [v.v_codes for v in vs], vs[0].layout, vs[0].group,
            [v.k_params for v in vs], [v.v_params for v in vs], vs[0].rotation_signs,
        )  # fmt: skip

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
        args = (
            residual, self.in_norms, self.post_norms, *self._args, rope.positions, rope.cos,
            rope.sin, caches.k, caches.v,
            meta.slot_mapping, kr.block_tables, kr.table_index, kr.context_lens, scale,
            self.windows, heads.num_heads, heads.num_kv_heads, heads.head_dim, eps,
        )  # fmt: skip
        if self.team and TEAM:
            h, res = self.kernels.decode_team(
                *args, caches.codec, caches.group, caches.k_params, caches.v_params,
                caches.signs,
            )  # fmt: skip
        else:
            h, res = self.kernels.decode_stack(*args)
        return h, res
