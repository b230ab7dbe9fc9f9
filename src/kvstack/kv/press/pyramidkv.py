"""PyramidKV: per-layer budgets, large at the bottom, small at the top (Cai et al.,
"PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
2024).

Lower layers attend broadly and keep more tokens; the budget falls linearly with depth.
The schedule is kvpress 0.5.5's ``PyramidKVPress.get_layer_budget`` exactly
(:func:`pyramid_budgets`, the same floats and Python ``round``): the shares of the top and
bottom layers beyond the window are in ratio ``BETA`` (20), the bottom one capped at
``n - window``; when the pyramid does not fit (its smallest layer would keep fewer than
``window`` tokens, e.g. short prompts or ratio 0.8) every layer keeps
``max(1, round(n * (1 - ratio)))``, kvpress's fallback to SnapKV. Within a layer, SnapKV's
scores pick the tokens; each layer's budget counts its window. In a paged cache every
layer shares one block table, so blocks are reclaimed only down to the *largest* layer
budget; the smaller layers mask their extra slots (the quality effect is PyramidKV's, the
memory saving is that of its largest layer). A sliding-window model's press sees only its
full-attention layers; each keeps the budget of its *model* layer index out of all the
model's layers, as kvpress's ``get_layer_budget(module)`` (``module.layer_idx``,
``num_hidden_layers``) on Gemma 3, whose sliding layers it skips.
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import PressInput, top_with_tail
from kvstack.kv.press.snapkv import SnapKVPress


def pyramid_budgets(
    n: int, ratio: float, num_layers: int, window: int = 64, beta: float = 20
) -> list[int]:
    """Tokens kept per layer, bottom to top: kvpress's ``get_layer_budget(layer, q_len=n)``."""
    assert beta >= 1, "beta must be at least 1"
    max_capacity_prompt = window + n * (1 - ratio)
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (n >= max_num >= min_num >= window):
        return [max(1, round(n * (1 - ratio)))] * num_layers  # kvpress's SnapKV fallback
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(max_num - layer * steps) for layer in range(num_layers)]


class PyramidKVPress(SnapKVPress):
    name = "pyramidkv"
    uniform = False
    paper = "Cai et al., 2024"
    BETA = 20

    def select(self, inp: PressInput) -> list[torch.Tensor]:
        budgets = pyramid_budgets(inp.n, self.ratio, inp.num_model_layers, self.window, self.BETA)
        out = []
        for layer, model_layer in enumerate(inp.model_layers):
            scores, w = self.layer_scores(inp, layer)
            out.append(top_with_tail(scores, min(budgets[model_layer], inp.n), w))
        return out
