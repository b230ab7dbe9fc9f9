"""SnapKV: observation-window voting with pooling (Li et al., "SnapKV: LLM Knows What You
are Looking for Before Generation", NeurIPS 2024).

The prompt's last ``window`` queries vote for earlier keys: their attention is averaged
over the window, smoothed by average pooling (``kernel`` 5) so neighbouring tokens
survive together, then averaged over the query heads of each KV group. The window itself
is kept. This is the order of the authors' code and of kvpress's ``SnapKVPress``
(window mean, then pool, then group mean; no rescaling), and the kept set is kvpress's
(``tests/kv/test_press_reference.py``).
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import PressInput, WindowScorePress, pool, window_scores


class SnapKVPress(WindowScorePress):
    name = "snapkv"
    paper = "Li et al., NeurIPS 2024"
    window = 64
    kernel = 5

    def layer_scores(self, inp: PressInput, layer: int) -> tuple[torch.Tensor, int]:
        """``[kv_heads, n - w]`` scores and the window ``w``: window mean, pool, group mean."""
        probs, w = window_scores(inp, layer, self.window)  # [h, w, n - w]
        pooled = pool(probs.mean(dim=1), self.kernel)  # [h, n - w]
        kvh = inp.keys[layer].shape[1]
        return pooled.view(kvh, -1, pooled.shape[-1]).mean(1), w
