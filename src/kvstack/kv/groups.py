"""KV cache groups of a hybrid model (vLLM v1's ``KVCacheGroupSpec``), for sliding-window layers.

A model whose layers attend differently (Gemma 3: 5 sliding-window layers per global
one; Qwen2 with ``max_window_layers``; Mistral: every layer slides) needs less KV for
its window layers: a window layer never reads a key older than its window again. The
hybrid KV manager (``kv/hybrid.py``) gives each *group* of layers its own block table,
so a window group can free the blocks that fell out of every window.

Layers are grouped by their window (None = every key), and each type's layers are cut
into groups of ``layers_per_page`` = gcd of the types' layer counts, so that every
group holds the same number of layers. A *page* (a block id of the shared pool) then
holds ``block_size`` tokens of K/V for the ``layers_per_page`` layers of one group, and
pages are interchangeable between groups (vLLM pads the groups to one size instead;
gcd needs no padding)::

    Gemma 3 270M, 18 layers, 15 local (W = 512) + 3 global:  layers_per_page = 3
      group 0 (full):   layers  5 11 17        <- full groups first
      group 1 (W 512):  layers  0  1  2
      group 2 (W 512):  layers  3  4  6
      ...
      group 5 (W 512):  layers 14 15 16

    storage k/v:  [layers_per_page, num_pages, block_size, kv_heads, head_dim]
    layer 6 -> group 2, slot 2: k[2][page] for the pages of group 2's block table

A model without windows is one group of all its layers: the plain paged layout.
Plain Python (no torch), layer 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import gcd


def blocks_held(num_tokens: int, window: int | None, block_size: int) -> int:
    """Blocks one layer of a sequence of ``num_tokens`` tokens holds while decoding: every
    block, or for a window layer (the hybrid KV manager, ``kv/hybrid.py``) the blocks from
    the first one its next row (position ``num_tokens``) can read: between ``W / bs`` and
    ``(W - 1) / bs + 1``, i.e. up to ``W - 1 + block_size`` tokens."""
    n = -(-num_tokens // block_size)
    dead = 0 if window is None else max(0, num_tokens - window + 1) // block_size
    return n - dead


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing one block table; ``window`` None = full attention."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVGroups:
    """How a model's layers map onto pages: ``groups[g].layers[j]`` lives in slot ``j``
    of group ``g``'s pages.

    Invariants: every layer is in exactly one group; all groups have
    ``layers_per_page`` layers; full-attention groups come first, window groups after,
    larger windows first (so group 0 has the largest window: its table has no hole
    where a later group has a block).
    """

    groups: tuple[KVGroup, ...]
    layers_per_page: int

    @classmethod
    def plan(cls, layer_windows: Sequence[int | None]) -> KVGroups:
        """Group layers by window (``ModelConfig.layer_window`` of each layer)."""
        if not layer_windows:
            raise ValueError("a model has at least one layer")
        by_window: dict[int | None, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            by_window.setdefault(w, []).append(layer)
        size = 0
        for layers in by_window.values():
            size = gcd(size, len(layers))
        order = sorted(by_window, key=lambda w: (w is not None, -(w or 0)))  # full, widest
        groups = [
            KVGroup(w, tuple(by_window[w][i : i + size]))
            for w in order
            for i in range(0, len(by_window[w]), size)
        ]
        return cls(tuple(groups), size)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_layers(self) -> int:
        return self.num_groups * self.layers_per_page

    @property
    def hybrid(self) -> bool:
        """True when some group slides (the plain layout is one full group)."""
        return any(g.window is not None for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def pages_held(self, num_tokens: int, block_size: int) -> int:
        """Pages a sequence of ``num_tokens`` tokens holds while decoding (``kv/hybrid.py``
        frees what its next row, at position ``num_tokens``, cannot read): every block of
        a full group; of a window group, the blocks from ``first_live`` on."""
        return sum(blocks_held(num_tokens, w, block_size) for w in self.windows)

    def locate(self, layer: int) -> tuple[int, int]:
        """``(group, slot)`` of ``layer``."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV group")

    def layer_slots(self) -> list[int]:
        """Per layer, its slot in its group's pages (the storage's first index)."""
        out = [0] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layers):
                out[layer] = j
        return out

    def layer_groups(self) -> list[int]:
        """Per layer, its group (which block table its attention reads)."""
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return out

    def signature(self) -> str:
        """Each group's window and layers in slot order (what a page's bytes hold): offload
        tiers keep logical blocks of another grouping apart."""
        return ";".join(
            f"{'full' if g.window is None else g.window}:{','.join(map(str, g.layers))}"
            for g in self.groups
        )

    def describe(self) -> str:
        """One line for the startup log."""
        parts = []
        for w in dict.fromkeys(self.windows):
            n = self.windows.count(w)
            parts.append(f"{n} x {'full' if w is None else f'window {w}'}")
        return f"{self.num_groups} KV groups of {self.layers_per_page} layers ({', '.join(parts)})"
