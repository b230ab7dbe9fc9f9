"""Layer-DefensiveKV: DefensiveKV's scores with budgets shared across layers (Feng et
al., ICLR 2026).

All layers' defensive scores compete for one global budget (``m`` tokens per head times
the number of layers): a layer gets as many tokens per head as its scores win in a
global top-k, so layers whose attention is spread keep more. Each layer keeps at least
its window. As with PyramidKV, a paged cache reclaims blocks down to the largest layer
budget and masks the rest.
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import PressInput, top_with_tail
from kvstack.kv.press.defensivekv import DefensiveKVPress


class LayerDefensiveKVPress(DefensiveKVPress):
    name = "layer_defensivekv"
    uniform = False
    paper = "Feng et al., ICLR 2026 (layer-wise budgets)"

    def select(self, inp: PressInput) -> list[torch.Tensor]:
        m = self.budget(inp.n)
        per_layer = [self.layer_scores(inp, layer) for layer in range(inp.num_layers)]
        w = per_layer[0][1]
        free = max(0, m - w)  # per head and layer, beyond the window
        if free == 0:
            return [top_with_tail(s, m, w) for s, w in per_layer]
        # Normalize each layer's scores to sum 1 per head, so layers compete on shares.
        shares = [s / s.sum(-1, keepdim=True).clamp_min(1e-12) for s, _ in per_layer]
        flat = torch.cat([sh.mean(0) for sh in shares])  # head-averaged, all layers
        k = min(flat.numel(), free * inp.num_layers)
        won = torch.zeros(flat.numel(), dtype=torch.long)
        won[flat.topk(k).indices] = 1
        counts = won.split([sh.shape[-1] for sh in shares])
        out = []
        for (scores, wl), c in zip(per_layer, counts, strict=True):
            out.append(top_with_tail(scores, int(c.sum()) + wl, wl))
        return out
