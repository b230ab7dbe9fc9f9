"""Knorm: keep the keys with the *smallest* L2 norm (Devoto et al., "A Simple and
Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024; kvpress's
``KnormPress``).

Low-norm keys correlate with high attention, so the largest-norm keys go first. Per
head and layer; needs neither queries nor attention.
"""

from __future__ import annotations

import torch

from kvstack.kv.press.base import Press, PressInput


class KnormPress(Press):
    name = "knorm"
    paper = "Devoto et al., EMNLP 2024"

    def select(self, inp: PressInput) -> list[torch.Tensor]:
        m = self.kept(inp)
        out = []
        for k in inp.keys:
            norms = k.norm(dim=-1).T  # [kv_heads, n]
            out.append((-norms).topk(m, dim=-1).indices.sort(dim=-1).values)
        return out
