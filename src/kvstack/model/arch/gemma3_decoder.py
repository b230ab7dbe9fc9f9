"""Gemma 3 text decoder (transformers ``models/gemma3/modeling_gemma3.py``) on the paged KV
cache: the Llama forward's linears, attention and KV writes, with Gemma's layer around them.

``Gemma3DecoderLayer`` wraps both sub-layers in norms (sandwich norms); the residual
stream is carried as in ``model/arch/decoder.py`` (each ``add_norm`` first adds the previous
sub-layer's output to ``residual``)::

    residual = embed(ids) * sqrt(hidden)          (the scale rounded to the model dtype)
    per layer:  x = input_norm(residual)          (add_norm of the last MLP output)
                q, k = q_norm(q_h), k_norm(k_h)   per head, then RoPE (local or global base)
                a = post_attention_norm(attention(q, k, v) Wo)
                x, residual = add_norm(a, residual) with pre_feedforward_norm
                h = post_feedforward_norm(down(gelu_tanh(x Wgate) * x Wup))
    logits = norm(residual + h) Wembed^T

Every Gemma RMSNorm scales by ``1 + w`` (``Gemma3RMSNorm``): the 1 is folded into the
weights once, in float32, so the shared RMSNorm ops run unchanged. Local (sliding) layers
attend to ``sliding_window`` keys with RoPE base ``rope_local_theta``; global ones to all
keys with ``rope_theta``; the attention scale is ``query_pre_attn_scalar ** -0.5``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstack.core.model_config import ModelConfig
from kvstack.kv.storage import KVStorage
from kvstack.model.arch.decoder import LlamaModel, head_rms_norm
from kvstack.model.arch.layers import Rotary
from kvstack.model.arch.ops import LayerOps
from kvstack.model.attention import AttentionMetadata, capture_queries, paged_attention
from kvstack.model.quant.schemes import LinearBuilder


@dataclass
class GemmaNorms:
    """A layer's norms beyond Llama's two, ``1 + w`` folded in."""

    pre_feedforward: torch.Tensor
    post_feedforward: torch.Tensor


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: ``gelu_pytorch_tanh(gate) * up`` of the fused ``[T, 2 I]`` rows."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Gemma3Model(LlamaModel):
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        ops: LayerOps | None = None,
        linears: LinearBuilder | None = None,
    ) -> None:
        super().__init__(config, weights, dtype, ops, linears)

        def norm(name: str) -> torch.Tensor:  # Gemma3RMSNorm: x * (1 + w)
            return (1.0 + weights[name].float()).to(dtype)

        # Gemma3TextScaledWordEmbedding: the scale is cast to the embedding dtype first.
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)
        self.gemma_norms: list[GemmaNorms] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm = norm(p + "input_layernorm.weight")
            layer.post_norm = norm(p + "post_attention_layernorm.weight")
            layer.q_norm = norm(p + "self_attn.q_norm.weight")
            layer.k_norm = norm(p + "self_attn.k_norm.weight")
            self.gemma_norms.append(
                GemmaNorms(
                    norm(p + "pre_feedforward_layernorm.weight"),
                    norm(p + "post_feedforward_layernorm.weight"),
                )
            )
        self.norm = norm("model.norm.weight")
        local = config.rope_local_theta or config.rope_theta
        self.rotary_local = Rotary(config.head_dim, config.max_position_embeddings, local, None)
        self.local = [
            config.layer_rope_theta(i) != config.rope_theta for i in range(len(self.layers))
        ]

    def rotary_for(self, layer: int) -> Rotary:
        return self.rotary_local if self.local[layer] else self.rotary

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVStorage,
        logits_indices: torch.Tensor | None,
        float_logits: bool = True,
        stop_after_kv_of: int | None = None,
    ) -> torch.Tensor:
        """As ``LlamaModel.forward``: logits of ``logits_indices`` (all rows if None)."""
        eps, ops, heads = self.config.rms_norm_eps, self.ops, self.heads
        t = input_ids.shape[0]
        residual = self.embed[input_ids] * self.embed_scale
        ropes = (
            ops.rope_input(self.rotary, positions, self.dtype),
            ops.rope_input(self.rotary_local, positions, self.dtype),
        )
        h: torch.Tensor | None = None
        for li, (layer, extra) in enumerate(zip(self.layers, self.gemma_norms, strict=True)):
            if h is None:
                x = ops.rms_norm(residual, layer.input_norm, eps)
            else:
                x, residual = ops.add_rms_norm(h, residual, layer.input_norm, eps)
            qkv = layer.qkv(x)
            head_rms_norm(ops, qkv, heads, layer, eps)
            cache, m = kv.layer(li), meta.for_layer(li)
            rope = ropes[1] if self.local[li] else ropes[0]
            q, k, v = ops.rope_and_cache(qkv, rope, heads, cache, m.slot_mapping)
            if li == stop_after_kv_of:
                return q.new_empty(0)
            capture_queries(meta, q)  # a press's window queries (every layer's)
            a = paged_attention(q, k, v, cache, m, self.scale, self.windows[li])
            a = ops.rms_norm(layer.o(a.reshape(t, heads.q_size)), layer.post_norm, eps)
            x, residual = ops.add_rms_norm(a, residual, extra.pre_feedforward, eps)
            mlp = layer.down(gelu_tanh_and_mul(layer.gate_up(x)))
            h = ops.rms_norm(mlp, extra.post_feedforward, eps)
        assert h is not None
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        x, _ = ops.add_rms_norm(h, residual, self.norm, eps)
        logits = self.lm_head(x)
        return logits.float() if float_logits else logits


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """The forward of ``config``'s family: Gemma 3's layer, or the Llama one."""
    return Gemma3Model if config.architecture == "gemma3" else LlamaModel
