"""Physical KV memory of the paged cache (vLLM PagedAttention layout), through a codec.

Without a codec (``--kv-cache-dtype auto``) ``k[layer]`` and ``v[layer]`` have shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; the token at position ``p`` of a
request whose block table is ``B`` lives in slot ``B[p // block_size] * block_size + p %
block_size``, and attention reads the tensors in place. With a codec (KV compression,
``kv/codecs/``) the same slots hold codes and scales, and attention reads blocks back
through ``gather``.

With KV groups (the hybrid KV manager, ``kv/groups.py``) a block is a *page* of
``layers_per_page`` layers: ``k`` is ``[layers_per_page, num_pages, ...]`` and layer ``i``
reads slot ``layer_slots()[i]`` through its group's block table.

This is the only place (with the model) where KV memory exists; the block pool only
counts block ids. Whole blocks move in and out as bytes (``read_blocks`` /
``write_block``: each block-indexed tensor's slice of the block, in ``block_tensors``
order) for the offload tiers; presses use ``layer(i).gather`` and ``write``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.core.errors import ConfigError
from kvstack.core.model_config import ModelConfig
from kvstack.kv.codecs import CacheShape, IdentityCodec, KernelView, KVCodec, codec_class
from kvstack.kv.groups import KVGroups


@dataclass
class LayerCache:
    """One layer's view for attention: raw tensors (identity codec) or the codec."""

    layer: int
    codec: KVCodec
    k: torch.Tensor | None  # [num_blocks, bs, kv_heads, head_dim] when identity
    v: torch.Tensor | None
    slot: int = -1  # the layer's index in the storage (hybrid: in its group's pages)
    group: int = 0  # the KV group whose pages hold it (hybrid KV manager)

    def __post_init__(self) -> None:
        if self.slot < 0:
            self.slot = self.layer

    @property
    def identity(self) -> bool:
        return self.k is not None

    @property
    def kernel_view(self) -> KernelView | None:
        """How the C++ codec attention reads this layer in place (None: it cannot)."""
        return None if self.k is not None else self.codec.kernel_view(self.slot, self.group)

    @property
    def per_token_view(self) -> KernelView | None:
        """This layer's per-token codec storage, for the C++ write and gather (None: the
        codec's ``write`` / ``gather``)."""
        return None if self.k is not None else self.codec.per_token_view(self.slot)

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernels: Any = None
    ) -> bool:
        """Store new K/V rows ``[T, kv_heads, head_dim]`` of this layer at ``slots``;
        whether ``kernels`` did it (``KVCodec.write``)."""
        return self.codec.write(self.slot, slots, k, v, kernels, self.group)

    def gather(
        self, block_ids: torch.Tensor, kernels: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole blocks, ``block_ids.shape + (bs, kv_heads, head_dim)``; with the C++
        kernels a codec with a ``gather_view`` (per-token codecs, kivi2) has its blocks
        dequantized by ``codec_gather`` (the same values as the codec's ``gather``)."""
        if self.k is not None and self.v is not None:
            return self.k[block_ids], self.v[block_ids]
        view = self.codec.gather_view(self.slot) if kernels is not None else None
        if view is not None:
            k, v = kernels.codec_gather(
                view.layout, view.group, view.k_codes, view.v_codes, view.k_params,
                view.v_params, view.rotation_signs, block_ids, self.codec.shape.head_dim,
                self.codec.dtype, view.res_k, view.res_v, view.residual_of,
            )  # fmt: skip
            return k, v
        return self.codec.gather(self.slot, block_ids)

    @property
    def own_block_exact(self) -> bool:
        """A row reads its own block through ``gather_own`` (``KVCodec.own_block_exact``)."""
        return self.k is None and self.codec.own_block_exact

    def gather_own(
        self, block_ids: torch.Tensor, kernels: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of whole blocks as the rows inside them read them (``KVCodec.gather_own``)."""
        if self.k is not None and self.v is not None:
            return self.k[block_ids], self.v[block_ids]
        k, v = self.gather(block_ids, kernels)
        return self.codec.overlay_own(self.slot, block_ids, k, v, self.group)

    def overlay_own(
        self, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered blocks (``gather``) turned into ``gather_own``'s (``KVCodec.overlay_own``)."""
        if self.k is not None:
            return k, v
        return self.codec.overlay_own(self.slot, block_ids, k, v, self.group)


class KVStorage:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        codec: str = "auto",
        max_num_seqs: int = 1,
        groups: KVGroups | None = None,
    ) -> None:
        """``groups`` (hybrid KV manager, ``kv/groups.py``): blocks are pages of
        ``groups.layers_per_page`` layers and layer ``i`` lives in slot
        ``groups.layer_slots()[i]`` of its group's pages."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.groups = groups
        self._slots = groups.layer_slots() if groups is not None else None
        self._layer_groups = groups.layer_groups() if groups is not None else None
        self.shape = self.cache_shape(config, num_blocks, block_size, groups)
        try:
            self.codec: KVCodec = codec_class(codec)(self.shape, dtype, max_num_seqs)
        except (MemoryError, OSError, RuntimeError) as e:  # ENOMEM from mmap / the allocator
            if isinstance(e, RuntimeError) and "allocate" not in str(e):
                raise
            need = self.bytes_per_block(config, block_size, dtype, codec) * num_blocks
            raise ConfigError(
                f"cannot allocate the KV cache: {num_blocks} blocks of {block_size} tokens "
                f"= {need / 2**30:.2f} GiB ({type(e).__name__}: {e}); give a smaller "
                "--kv-cache-memory / --num-blocks"
            ) from e
        ident = isinstance(self.codec, IdentityCodec) and self.codec.identity
        self._k = self.codec.k if ident else None  # type: ignore[attr-defined]
        self._v = self.codec.v if ident else None  # type: ignore[attr-defined]
        self._layer_views: tuple[torch.Tensor | None, dict[int, LayerCache]] | None = None

    @staticmethod
    def cache_shape(
        config: ModelConfig, num_blocks: int, block_size: int, groups: KVGroups | None = None
    ) -> CacheShape:
        if groups is None:
            return CacheShape(
                config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim
            )
        return CacheShape(
            groups.layers_per_page, num_blocks, block_size, config.num_kv_heads,
            config.head_dim, groups.num_groups,
        )  # fmt: skip

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def bytes_per_block(
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        codec: str = "auto",
        groups: KVGroups | None = None,
    ) -> float:
        """Bytes of one block (hybrid: one page, ``groups.layers_per_page`` layers)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_head = codec_class(codec).bytes_per_token_head(config.head_dim, block_size, itemsize)
        layers = config.num_layers if groups is None else groups.layers_per_page
        return layers * config.num_kv_heads * block_size * per_head

    @classmethod
    def num_blocks_for_memory(
        cls,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        memory_bytes: int,
        codec: str = "auto",
        max_num_seqs: int = 1,
        groups: KVGroups | None = None,
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        shape = cls.cache_shape(config, 0, block_size, groups)
        fixed = codec_class(codec).fixed_bytes(shape, max_num_seqs, itemsize)
        per_block = cls.bytes_per_block(config, block_size, dtype, codec, groups)
        return int((memory_bytes - fixed) // per_block)

    @property
    def nbytes(self) -> int:
        return self.codec.nbytes

    # ------------------------------------------------------------------ access
    @property
    def k(self) -> torch.Tensor:
        """Raw K ``[layers, blocks, bs, kv_heads, head_dim]`` (identity codec only)."""
        assert self._k is not None, "the KV cache is encoded; use layer(i).gather"
        return self._k

    @property
    def v(self) -> torch.Tensor:
        assert self._v is not None, "the KV cache is encoded; use layer(i).gather"
        return self._v

    def layer(self, layer: int) -> LayerCache:
        """One layer's view (built once per layer: the forward asks for it every step)."""
        views = self._layer_views
        if views is None or views[0] is not self._k:
            views = self._layer_views = (self._k, {})
        cache = views[1].get(layer)
        if cache is None:
            slot = layer if self._slots is None else self._slots[layer]
            group = 0 if self._layer_groups is None else self._layer_groups[layer]
            if self._k is not None and self._v is not None:
                cache = LayerCache(layer, self.codec, self._k[slot], self._v[slot], slot, group)
            else:
                cache = LayerCache(layer, self.codec, None, None, slot, group)
            views[1][layer] = cache
        return cache

    def block_tensors(self) -> list[torch.Tensor]:
        """Every block-indexed tensor ``[layers, blocks, ...]`` (what offload tiers copy)."""
        return self.codec.tensors()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V rows ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]``."""
        self.layer(layer).write(slots, k, v)

    # ------------------------------------------------------------------ whole blocks
    @property
    def itemsize(self) -> int:
        """Bytes of one element of the activation dtype."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across every layer and block-indexed tensor."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.block_tensors())

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' contents as bytes, ``uint8 [len(block_ids), block_nbytes]``."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        parts = [  # each tensor's block slices: [n, bytes of one block]
            t[:, ids].transpose(0, 1).contiguous().view(torch.uint8).reshape(len(ids), -1)
            for t in self.block_tensors()
        ]
        return torch.cat(parts, dim=1)

    def write_block(self, block_id: int, raw: torch.Tensor) -> None:
        """Overwrite block ``block_id`` with ``raw`` bytes laid out as ``read_blocks`` does."""
        offset = 0
        for t in self.block_tensors():
            dst = t[:, block_id]
            size = dst.numel() * dst.element_size()
            dst.copy_(raw[offset : offset + size].view(t.dtype).view(dst.shape))
            offset += size
