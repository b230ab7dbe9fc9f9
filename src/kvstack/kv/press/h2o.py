"""H2O: heavy hitters + recent tokens (Zhang et al., "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models", NeurIPS 2023).

Tokens that accumulate the most attention ("heavy hitters") keep half the budget, the
most recent tokens the other half. H2O accumulates over every query; to keep the press
linear in the prompt length kvstack accumulates over the last ``window`` (256) prompt
queries, summed over the query heads of each KV group, without pooling.
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import Press, PressInput, top_with_tail, window_attention


class H2OPress(Press):
    name = "h2o"
    paper = "Zhang et al., NeurIPS 2023"
    window = 256

    def select(self, inp: PressInput) -> list[torch.Tensor]:
        assert inp.queries is not None, "h2o needs the prompt's window queries"
        n, m = inp.n, self.kept(inp)
        recent = min(m // 2, n - 1)
        out = []
        for layer in range(inp.num_layers):
            q = inp.queries[layer]
            w = min(self.window, q.shape[0])
            probs = window_attention(q[-w:], inp.keys[layer], inp.scale)  # [h, w, n]
            kvh = inp.keys[layer].shape[1]
            acc = probs.sum(1).view(kvh, -1, n).sum(1)  # [kv_heads, n]
            out.append(top_with_tail(acc[:, : n - recent], m, recent))
        return out
