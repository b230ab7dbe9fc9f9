"""DefensiveKV: worst-case instead of mean aggregation of window scores (Feng et al.,
"Taming the Fragility of KV Cache Eviction in LLM Inference", ICLR 2026).

SnapKV averages the window's votes, trusting that the tokens important now stay
important. DefensiveKV takes, per token, the *maximum* of the pooled window scores over
the window's queries and over the query heads of the KV group, then clamps each score
from below at the mean score of its head, so no token is judged by its average alone.
Each query's attention row is pooled as SnapKV pools (average pooling, width 5, no
rescaling). The window itself is kept. (The authors' code adds CriticalKV's value-norm
stage and AdaKV's head-wise budgets; kvstack keeps equal budgets per head and scores
only. kvpress has no DefensiveKV to compare with.)
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import PressInput, WindowScorePress, pool, window_scores


class DefensiveKVPress(WindowScorePress):
    name = "defensivekv"
    paper = "Feng et al., ICLR 2026"
    window = 32
    kernel = 5

    def layer_scores(self, inp: PressInput, layer: int) -> tuple[torch.Tensor, int]:
        """Defensive scores ``[kv_heads, n - w]`` and the window ``w``."""
        probs, w = window_scores(inp, layer, self.window)  # [h, w, n - w]
        pooled = pool(probs, self.kernel)  # each query's row pooled
        kvh = inp.keys[layer].shape[1]
        worst = pooled.amax(1).view(kvh, -1, pooled.shape[-1]).amax(1)  # max: window, group
        return worst.clamp(min=worst.mean(-1, keepdim=True)), w
