"""``LayerWeights``: one decoder layer's weights, as the forward and the C++ stack read them.

The norms are plain tensors in the model's dtype; each linear is a ``LinearOp`` (a float
``Linear`` or a packed ``QuantLinear``), with q, k and v fused into ``qkv`` and the gate
and up projections into ``gate_up`` (the layout vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstack.model.quant.schemes import LinearOp


@dataclass
class LayerWeights:
    """The tensors of one layer; the optional ones are set only by the families that have them."""

    input_norm: torch.Tensor
    qkv: LinearOp
    o: LinearOp
    post_norm: torch.Tensor
    gate_up: LinearOp
    down: LinearOp
    qkv_bias: torch.Tensor | None = None  # [(H + 2 KVH) d] (Qwen2)
    q_norm: torch.Tensor | None = None  # [d] per-head RMSNorm weights (Qwen3)
    k_norm: torch.Tensor | None = None
