"""``auto``: K/V stored unchanged in the activation dtype (attention reads them in place)."""

from __future__ import annotations

from typing import Any

import torch

from kvstack.core import hugepages
from kvstack.kv.codecs.base import CacheShape, KernelView, KVCodec


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
        # On huge pages (kvstack/core/hugepages.py): attention reads blocks scattered over the
        # pool, and with 4 KiB pages nearly every block read missed the TLB (batch 32 x 230
        # tokens, random blocks, 2-core EPYC: 30 layers 19-21 ms -> 16.6-18.5 ms).
        # Faulted in now (zero_), as torch.zeros did: first-touch faults would otherwise
        # land in the first steps that write each block.
        self.k = hugepages.zeros(full, sd).zero_()
        self.v = hugepages.zeros(full, sd).zero_()
        self.k_slots = self.k.view(s.num_layers, -1, s.num_kv_heads, s.head_dim)
        self.v_slots = self.v.view(s.num_layers, -1, s.num_kv_heads, s.head_dim)

    @classmethod
    def bytes_per_token_head(cls, head_dim: int, block_size: int, act_itemsize: int) -> float:
        return 2 * head_dim * (cls.store_dtype.itemsize if cls.store_dtype else act_itemsize)

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kernels: Any = None,
        group: int = 0,
    ) -> bool:
        self.k_slots[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v_slots[layer].index_copy_(0, slots, v.to(self.v.dtype))
        return False

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][block_ids].to(self.dtype), self.v[layer][block_ids].to(self.dtype)

    def kernel_view(self, layer: int, group: int = 0) -> KernelView | None:
        """bf16 storage under a float32 model (``bf16``); None for ``auto``, which
        attention reads in place as plain tensors."""
        if self.identity or self.k.dtype != torch.bfloat16:
            return None
        empty = torch.empty(0, dtype=torch.bfloat16)
        return KernelView("bf16", self.k[layer], self.v[layer], empty, empty)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]
