"""Physical KV tensors of the paged cache (vLLM PagedAttention layout).

``k[layer]`` and ``v[layer]`` have shape ``[num_blocks, block_size, num_kv_heads,
head_dim]``; the token at position ``p`` of a request whose block table is ``B`` lives
in slot ``B[p // block_size] * block_size + p % block_size``. The flattened view
``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed by slot.

This is the only place (with the model) where KV memory exists; the block pool only
counts block ids.
"""

from __future__ import annotations

import torch

from kvstack.config import ModelConfig


class KVStorage:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        # Slot-indexed views: [num_layers, num_slots, kv_heads, head_dim].
        self.k_slots = self.k.view(config.num_layers, -1, config.num_kv_heads, config.head_dim)
        self.v_slots = self.v.view(config.num_layers, -1, config.num_kv_heads, config.head_dim)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.kv_bytes_per_token(itemsize) * block_size

    @classmethod
    def num_blocks_for_memory(
        cls, config: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int
    ) -> int:
        return memory_bytes // cls.bytes_per_block(config, block_size, dtype)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V rows ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]``."""
        self.k_slots[layer].index_copy_(0, slots, k)
        self.v_slots[layer].index_copy_(0, slots, v)
