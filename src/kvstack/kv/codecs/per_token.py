"""Codecs that encode each token's K and V rows alone (codes + per-row or group params)."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from kvstack.kv.codecs.base import CacheShape, KernelView, KVCodec


class PerTokenCodec(KVCodec):
    """Each token's K and V rows are encoded alone: codes + per-row (or group) params."""

    code_dtype: ClassVar[torch.dtype]
    code_width: ClassVar[int]  # code elements per head_dim elements: d, d/2 ...
    num_params: ClassVar[int]  # bf16 parameters per row (per head) for K or V
    kernel_layout: ClassVar[str | None] = None  # KernelView.layout, None: no kernel

    def __init__(self, shape: CacheShape, dtype: torch.dtype, max_num_seqs: int = 0) -> None:
        super().__init__(shape, dtype, max_num_seqs)
        s = shape
        rows = (s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads)
        cw, npar = self.code_cols(s.head_dim), self.param_cols(s.head_dim)
        self.k_codes = torch.zeros((*rows, cw), dtype=self.code_dtype)
        self.v_codes = torch.zeros((*rows, cw), dtype=self.code_dtype)
        self.k_params = torch.zeros((*rows, npar), dtype=torch.bfloat16)
        self.v_params = torch.zeros((*rows, npar), dtype=torch.bfloat16)
        # The storage never moves, so each layer's view is built once (views of a layer's
        # slices cost ~1 us each, four per layer per step).
        self._views: dict[int, KernelView | None] = {}

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

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kernels: Any = None,
        group: int = 0,
    ) -> bool:
        """The PyTorch reference (the engine's C++ ``codec_write`` stores the same bits)."""
        for x, codes, params in (
            (k, self.k_codes, self.k_params),
            (v, self.v_codes, self.v_params),
        ):
            c, p = self.encode(x)
            codes[layer].view(-1, *codes.shape[3:]).index_copy_(0, slots, c)
            params[layer].view(-1, *params.shape[3:]).index_copy_(0, slots, p)
        return False

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.decode(self.k_codes[layer][block_ids], self.k_params[layer][block_ids])
        v = self.decode(self.v_codes[layer][block_ids], self.v_params[layer][block_ids])
        return k.to(self.dtype), v.to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.v_codes, self.k_params, self.v_params]

    def kernel_group(self) -> int:
        """Channels per (scale, zero) pair in the kernel's view (0: the whole head)."""
        return 0

    def kernel_view(self, layer: int, group: int = 0) -> KernelView | None:
        if layer not in self._views:
            self._views[layer] = self.build_kernel_view(layer)
        return self._views[layer]

    def build_kernel_view(self, layer: int) -> KernelView | None:
        """``kernel_view`` before caching (subclasses add to it here)."""
        if self.kernel_layout is None:
            return None
        return KernelView(
            self.kernel_layout,
            self.k_codes[layer],
            self.v_codes[layer],
            self.k_params[layer],
            self.v_params[layer],
            group=self.kernel_group(),
        )

    def per_token_view(self, layer: int) -> KernelView | None:
        """Every per-token codec with a kernel layout (int8, fp8, int4, rotated4: the
        layouts ``codec_write.cpp`` encodes and ``codec_gather.cpp`` decodes)."""
        return self.kernel_view(layer)
