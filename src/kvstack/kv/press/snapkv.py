"""SnapKV: observation-window voting with pooling (Li et al., "SnapKV: LLM Knows What You
are Looking for Before Generation", NeurIPS 2024).

The prompt's last ``window`` queries vote for earlier keys: their attention, averaged
over the window and over the query heads of each KV group, smoothed by average pooling
(``kernel`` 5) so neighbouring tokens survive together. The window itself is kept.
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import PressInput, WindowScorePress, pooled_window_scores


class SnapKVPress(WindowScorePress):
    name = "snapkv"
    paper = "Li et al., NeurIPS 2024"
    window = 64
    kernel = 5

    def layer_scores(self, inp: PressInput, layer: int) -> tuple[torch.Tensor, int]:
        """``[kv_heads, n - w]`` scores and the window ``w``: mean over window and group."""
        pooled, w = pooled_window_scores(inp, layer, self.window, self.kernel)
        kvh = inp.keys[layer].shape[1]
        return pooled.mean(1).view(kvh, -1, pooled.shape[-1]).mean(1), w
