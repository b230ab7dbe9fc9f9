"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) on a paged KV cache.

One ``forward`` runs all tokens of a step, flattened: the linear layers see one
``[T, hidden]`` matrix (prefill chunks and decode tokens of many requests together),
attention splits by request (``model/attention.py``). Logits are computed only for the
rows that sample (``logits_indices``): the tied lm_head is the most expensive GEMM.

Weights come in Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``...);
q/k/v and gate/up are fused into one matrix each so a layer runs four GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstack.errors import ModelLoadError
from kvstack.kv.storage import KVStorage
from kvstack.model.attention import AttentionMetadata, paged_attention
from kvstack.model.layers import Linear, Rotary, apply_rope, rms_norm
from kvstack.model_config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> None:
        self.config = config
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"model weights lack tensor {name!r}")
            return weights[name]

        self.embed = w("model.embed_tokens.weight").to(dtype)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat(
                [
                    w(p + "self_attn.q_proj.weight"),
                    w(p + "self_attn.k_proj.weight"),
                    w(p + "self_attn.v_proj.weight"),
                ]
            )
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight").to(dtype),
                    qkv=Linear(qkv, dtype),
                    o=Linear(w(p + "self_attn.o_proj.weight"), dtype),
                    post_norm=w(p + "post_attention_layernorm.weight").to(dtype),
                    gate_up=Linear(gate_up, dtype),
                    down=Linear(w(p + "mlp.down_proj.weight"), dtype),
                )
            )
        self.norm = w("model.norm.weight").to(dtype)
        head = weights.get("lm_head.weight")
        if head is None or config.tie_word_embeddings:
            head = w("model.embed_tokens.weight")
        self.lm_head = Linear(head, dtype)
        self.rotary = Rotary(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qk_heads = config.num_heads + config.num_kv_heads

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVStorage,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Return float32 logits ``[len(logits_indices), vocab]`` (all rows if None)."""
        cfg = self.config
        t = input_ids.shape[0]
        h = self.embed[input_ids]
        cos, sin = self.rotary.tables(positions, self.dtype)
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x)
            # RoPE on q and k heads in one call: [T, H + KVH, d].
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.qk_heads, cfg.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
            for rid, (r0, r1) in meta.capture_rows.items():  # era 5 press window queries
                meta.captured.setdefault(rid, []).append(q[r0:r1].to(torch.float32, copy=True))
            kv.write(li, meta.slot_mapping, k, v)
            a = paged_attention(q, k, v, kv.layer(li), meta, self.scale)
            h = h + layer.o(a.reshape(t, self.q_size))
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        if logits_indices is not None:
            h = h[logits_indices]
        h = rms_norm(h, self.norm, cfg.rms_norm_eps)
        return self.lm_head(h).float()
