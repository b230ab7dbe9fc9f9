"""PyramidKV: per-layer budgets, large at the bottom, small at the top (Cai et al.,
"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
2024).

Lower layers attend broadly and keep more tokens; the budget falls linearly with depth
(an arithmetic sequence with ratio ``BETA`` between the extremes' shares, as kvpress's
``PyramidKVPress``), averaging the uniform budget ``m``. Within a layer, SnapKV's scores
pick the tokens. In a paged cache every layer shares one block table, so blocks are
reclaimed only down to the *largest* layer budget; the smaller layers mask their extra
slots (the quality effect is PyramidKV's, the memory saving is that of its largest layer).
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import PressInput, top_with_tail
from kvstack.kv.press.snapkv import SnapKVPress


def pyramid_budgets(m: int, n: int, num_layers: int, window: int, beta: float) -> list[int]:
    """Per-layer budgets, bottom to top, mean ``m``, each in ``[min(window, m), n]``."""
    if num_layers == 1 or m <= window or m >= n:
        return [min(m, n)] * num_layers
    free = m - window  # the window is kept in every layer
    low = free / beta
    high = 2 * free - low
    step = (high - low) / (num_layers - 1)
    return [min(n, window + round(high - i * step)) for i in range(num_layers)]


class PyramidKVPress(SnapKVPress):
    name = "pyramidkv"
    uniform = False
    paper = "Cai et al., 2024"
    BETA = 20.0

    def select(self, inp: PressInput) -> list[torch.Tensor]:
        m = self.budget(inp.n)
        budgets = pyramid_budgets(m, inp.n, inp.num_layers, self.window, self.BETA)
        out = []
        for layer, b in enumerate(budgets):
            scores, w = self.layer_scores(inp, layer)
            out.append(top_with_tail(scores, b, w))
        return out
