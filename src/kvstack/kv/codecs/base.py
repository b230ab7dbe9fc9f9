"""The codec protocol: ``KVCodec`` stores one cache's K/V blocks, ``CacheShape`` sizes it.

See ``kv/codecs/__init__.py`` for the table of codecs and their error bounds.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvstack.errors import ConfigError


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


class KVCodec(abc.ABC):
    name: ClassVar[str]
    identity: bool = False  # stores the activation dtype unchanged (attention reads in place)
    # Rejected draft slots (speculative decoding) may simply be written again: true of
    # codecs that encode each token alone; false of one that encodes a block as it fills.
    rolls_back: bool = True

    def __init__(self, shape: CacheShape, dtype: torch.dtype, max_num_seqs: int = 0) -> None:
        self.check_head_dim(shape.head_dim)
        self.shape = shape
        self.dtype = dtype  # activation dtype that gather returns

    @classmethod
    def check_head_dim(cls, head_dim: int) -> None:
        """Raise ``ConfigError`` if the codec cannot encode heads of this size."""
        if head_dim <= 0:
            raise ConfigError(f"head_dim must be positive, got {head_dim}")

    @classmethod
    @abc.abstractmethod
    def bytes_per_token_head(cls, head_dim: int, block_size: int, act_itemsize: int) -> float:
        """K+V bytes per token, per KV head and layer, scales included."""

    @classmethod
    def fixed_bytes(cls, shape: CacheShape, max_num_seqs: int, act_itemsize: int) -> int:
        """Bytes the codec needs besides the blocks (KIVI's residual)."""
        return 0

    @abc.abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows ``k, v`` ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]``."""

    @abc.abstractmethod
    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of whole blocks."""

    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every block-indexed tensor, ``[num_layers, num_blocks, ...]``."""

    def on_block_freed(self, block_id: int) -> None:  # noqa: B027 - optional hook
        """A block went back to the free queue (its contents are dead)."""

    def check_integrity(self) -> None:
        """Assert the codec's own invariants (here: every tensor is block-indexed)."""
        s = self.shape
        for t in self.tensors():
            assert t.shape[:2] == (s.num_layers, s.num_blocks), f"bad codec tensor {t.shape}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
