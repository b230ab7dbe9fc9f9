"""The codec protocol: ``KVCodec`` stores one cache's K/V blocks, ``CacheShape`` sizes it.

See ``kv/codecs/__init__.py`` for the table of codecs and their error bounds.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvstack.core.errors import ConfigError


@dataclass(frozen=True)
class KernelView:
    """How the C++ codec attention (``csrc/paged_attention_codecs.cpp``) reads one layer of
    a codec's storage in place: a layout name the kernel knows and that layer's tensors.

    Layouts: ``bf16`` (codes = bf16 rows, no parameters), ``int8`` and ``fp8_e4m3`` /
    ``fp8_e5m2`` (one bf16 scale per row), ``int4`` (packed nibbles, low nibble first; a
    bf16 (scale, zero) pair per ``group`` channels), ``kivi2`` (2-bit codes, keys with a
    (scale, zero) pair per block and channel ``[blocks, kv_heads, head_dim, 2]``, values
    one pair per ``group`` channels, plus the residual pool of filling blocks). Codes and
    per-row parameters are ``[blocks, block_size, kv_heads, ...]``. With
    ``rotation_signs`` ``s`` the codes hold ``x R``, ``R = diag(s) H / sqrt(head_dim)``
    (``H`` Sylvester's Hadamard matrix): the kernel scores ``q R`` against them and turns
    its output back with ``R^T`` (orthogonal), each a fast Walsh-Hadamard transform.
    """

    layout: str
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_params: torch.Tensor
    v_params: torch.Tensor
    group: int = 0  # channels per (scale, zero) pair; 0 = the whole head
    res_k: torch.Tensor | None = None  # kivi2: [slots, block_size, kv_heads, head_dim]
    res_v: torch.Tensor | None = None
    residual_of: torch.Tensor | None = None  # kivi2: [blocks] slot or -1
    rotation_signs: torch.Tensor | None = None  # [head_dim] float32, +-1


@dataclass(frozen=True)
class CacheShape:
    """``num_layers`` storage layers (hybrid KV manager: the layers of one page, shared by
    ``num_groups`` groups whose pages come from one pool of ``num_blocks``)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_groups: int = 1


class KVCodec(abc.ABC):
    name: ClassVar[str]
    identity: bool = False  # stores the activation dtype unchanged (attention reads in place)
    # Rejected draft slots (speculative decoding) may simply be written again: true of
    # codecs that encode each token alone; false of one that encodes a block as it fills.
    rolls_back: bool = True
    # The engine sends this codec's decodes and short chunks to the C++ codec attention
    # (through ``kernel_view``); False keeps the PyTorch reference path, counted as the
    # ``encoded_cache`` fallback.
    engine_kernel: bool = True
    # True when a row reads the tokens of its own block (``p // block_size``) otherwise
    # than the rows after that block do (KIVI: its own block at full precision, earlier
    # blocks decoded from codes); attention then reads the own block through
    # ``gather_own`` and the earlier ones through ``gather``.
    own_block_exact: bool = False

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
    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kernels: Any = None,
        group: int = 0,
    ) -> bool:
        """Store rows ``k, v`` ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]``; returns
        whether the C++ ``kernels`` (when given) did it (kivi2) rather than PyTorch.
        ``group``: the KV group whose pages ``slots`` point into (hybrid KV manager; the
        layers of one group see the same ``slots`` in a step, other groups other pages)."""

    @abc.abstractmethod
    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of whole blocks."""

    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every block-indexed tensor, ``[num_layers, num_blocks, ...]``."""

    def gather_own(
        self, layer: int, block_ids: torch.Tensor, group: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks as the rows inside them read them, right after this step
        wrote ``layer`` of ``group`` (``own_block_exact``); by default ``gather``'s."""
        return self.overlay_own(layer, block_ids, *self.gather(layer, block_ids), group=group)

    def kernel_view(self, layer: int, group: int = 0) -> KernelView | None:
        """How the C++ attention reads ``layer`` (of ``group``'s pages) in place, or None:
        attention then takes the PyTorch path (``gather``), counted as a ``kernel_fallback``."""
        return None

    def per_token_view(self, layer: int) -> KernelView | None:
        """``layer``'s storage when each token's rows are encoded alone (int8, fp8, int4,
        rotated4): the C++ KV write (``csrc/codec_write.cpp``) encodes new rows into it and
        ``csrc/codec_gather.cpp`` dequantizes whole blocks from it, each bit-identical to
        ``write`` / ``gather``. None: the codec's ``write`` and ``gather`` do it, the write
        counted as the ``kv_cache_write`` fallback unless ``write`` ran in C++ (kivi2)."""
        return None

    def gather_view(self, layer: int) -> KernelView | None:
        """``layer``'s storage as ``csrc/codec_gather.cpp`` decodes whole blocks from it, the
        same values as ``gather``: the per-token view, or kivi2's with the residual pool of
        its filling blocks. None: ``gather`` (PyTorch)."""
        return self.per_token_view(layer)

    def overlay_own(
        self,
        layer: int,
        block_ids: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Turns the gathered blocks ``k, v`` (``gather`` of ``block_ids``) into what
        ``gather_own`` returns, in place where it can; by default they are the same."""
        return k, v

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
