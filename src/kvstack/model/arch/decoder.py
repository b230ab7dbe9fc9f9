"""Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) on a paged KV cache.

It runs every family of ``model/arch/`` (llama, qwen2, qwen3, mistral): they differ only
in ``ModelConfig`` features applied to the fused q/k/v rows before RoPE, as their
transformers modeling files do (``qwen2/modeling_qwen2.py``: ``q_proj`` ... with a bias;
``qwen3/modeling_qwen3.py``: ``q_norm(q_proj(x).view(..., head_dim))``, the same for k)::

    qkv = x Wqkv (+ b_qkv if qkv_bias)
    q_h = rms_norm(q_h, w_qnorm), k_h = rms_norm(k_h, w_knorm)  per head, if qk_norm

One ``forward`` runs all tokens of a step, flattened: the linear layers see one
``[T, hidden]`` matrix (prefill chunks and decode tokens of many requests together),
attention splits by request (``model/attention.py``). Logits are computed only for the
rows that sample (``logits_indices``): the tied lm_head is the most expensive GEMM.

Weights come in Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``...);
q/k/v and gate/up are fused into one matrix each so a layer runs four GEMMs; each is a
dense ``Linear`` or a packed ``QuantLinear`` as ``--quantization`` decides
(``model/quant/schemes.py``, which also says which layers stay in the model dtype). Between
them run the per-token ops of ``model/arch/ops.py`` (``ops``: fused C++ when built, else the
PyTorch reference); the residual stream is carried as in vLLM: each norm first adds the
previous sub-layer's output to ``residual``::

    residual = embed(ids);  x = norm(residual)
    per layer:  qkv = x Wqkv;  RoPE + KV write;  a = attention
                x, residual = add_norm(a Wo, residual)      # residual += a Wo
                h = down(silu(x Wgate) * x Wup)
                x, residual = add_norm(h, residual)         # (next layer's input norm)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstack.core.errors import ModelLoadError
from kvstack.core.model_config import ModelConfig
from kvstack.kv.storage import KVStorage
from kvstack.model.arch.decode_stack import DecodeStack
from kvstack.model.arch.layers import Rotary
from kvstack.model.arch.ops import HeadShape, LayerOps, select_ops
from kvstack.model.arch.weights import LayerWeights
from kvstack.model.attention import AttentionMetadata, capture_queries, paged_attention
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.quant.schemes import LinearBuilder, LinearOp


def head_rms_norm(
    ops: LayerOps, qkv: torch.Tensor, heads: HeadShape, layer: LayerWeights, eps: float
) -> None:
    """Qwen3's per-head RMSNorm of the q and k heads of ``qkv`` ``[T, (H + 2 KVH) d]``, in
    place (each head of ``head_dim`` values normalized on its own, before RoPE)."""
    assert layer.q_norm is not None and layer.k_norm is not None
    t, d, qs, ks = qkv.shape[0], heads.head_dim, heads.q_size, heads.kv_size
    for lo, hi, w in ((0, qs, layer.q_norm), (qs, qs + ks, layer.k_norm)):
        part = qkv[:, lo:hi].reshape(-1, d)  # [T * heads, d]; rms_norm returns a new tensor
        qkv[:, lo:hi] = ops.rms_norm(part, w, eps).view(t, hi - lo)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        ops: LayerOps | None = None,
        linears: LinearBuilder | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        # The fused C++ ops when built (model/kernels/loader.py), else the PyTorch reference.
        self.ops: LayerOps = ops if ops is not None else select_ops(load_kernels())
        # Dense or packed linears (--quantization, model/quant/schemes.py).
        lin = linears if linears is not None else LinearBuilder("none", dtype)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"model weights lack tensor {name!r}")
            return weights[name]

        def linear(*names: str) -> LinearOp:
            missing = [n for n in names if n not in weights]  # no read: a packed one stays so
            if missing:
                raise ModelLoadError(f"model weights lack tensor {missing[0]!r}")
            return lin.build(list(names), weights)

        def optional(on: bool, *names: str) -> torch.Tensor | None:
            return torch.cat([w(n) for n in names]).to(dtype) if on else None

        self.embed = w("model.embed_tokens.weight").to(dtype)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight").to(dtype),
                    qkv=linear(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    o=linear(a + "o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight").to(dtype),
                    gate_up=linear(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                    down=linear(mlp + "down_proj.weight"),
                    qkv_bias=optional(
                        config.qkv_bias, a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"
                    ),
                    q_norm=optional(config.qk_norm, a + "q_norm.weight"),
                    k_norm=optional(config.qk_norm, a + "k_norm.weight"),
                )
            )
        self.norm = w("model.norm.weight").to(dtype)
        tied = "lm_head.weight" not in weights or config.tie_word_embeddings
        self.lm_head = linear("model.embed_tokens.weight" if tied else "lm_head.weight")
        self.quantization = lin.quantization
        lin.log()
        self.rotary = Rotary(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.scale = config.attention_scale  # head_dim ** -0.5 unless the family says
        # Per layer: its sliding window, None = every key (model/arch/window.py).
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]
        self.heads = HeadShape(config.num_heads, config.num_kv_heads, config.head_dim)
        # Every layer in one C++ call where the step allows (model/arch/decode_stack.py).
        self.stack = DecodeStack.build(config, self.layers, self.windows, self.dtype, self.ops.name)

    def rotary_for(self, layer: int) -> Rotary:
        """The RoPE tables layer ``layer``'s keys were rotated with."""
        return self.rotary

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
        """Return logits ``[len(logits_indices), vocab]`` (all rows if None): float32, or
        with ``float_logits=False`` in the model dtype (the runner's consumers convert
        what they need; greedy sampling reads bf16 logits directly).
        ``stop_after_kv_of=l`` stops once layer ``l``'s K/V are written (returns nothing):
        the segment repair probe (``model/segment_rows.py``)."""
        eps, ops, heads = self.config.rms_norm_eps, self.ops, self.heads
        t = input_ids.shape[0]
        residual = self.embed[input_ids]
        rope = ops.rope_input(self.rotary, positions, self.dtype)
        h: torch.Tensor | None = None  # the last sub-layer's output, not yet in residual
        stack = self.stack
        if stack is not None and stop_after_kv_of is None and stack.usable(t, meta, kv):
            h, residual = stack.run(residual, rope, meta, kv, heads, self.scale, eps)
            return self._logits(h, residual, logits_indices, float_logits)
        q_size = heads.q_size
        for li, layer in enumerate(self.layers):
            if h is None:
                x = ops.rms_norm(residual, layer.input_norm, eps)
            else:
                x, residual = ops.add_rms_norm(h, residual, layer.input_norm, eps)
            qkv = layer.qkv(x)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            if layer.q_norm is not None:
                head_rms_norm(ops, qkv, heads, layer, eps)
            cache, m = kv.layer(li), meta.for_layer(li)
            q, k, v = ops.rope_and_cache(qkv, rope, heads, cache, m.slot_mapping)
            if li == stop_after_kv_of:
                return q.new_empty(0)
            capture_queries(meta, q)  # a press's window queries
            a = paged_attention(q, k, v, cache, m, self.scale, self.windows[li])
            x, residual = ops.add_rms_norm(
                layer.o(a.reshape(t, q_size)), residual, layer.post_norm, eps
            )
            h = layer.down(ops.silu_and_mul(layer.gate_up(x)))
        assert h is not None
        return self._logits(h, residual, logits_indices, float_logits)

    def _logits(
        self,
        h: torch.Tensor,
        residual: torch.Tensor,
        logits_indices: torch.Tensor | None,
        float_logits: bool,
    ) -> torch.Tensor:
        """The final norm (adding the last MLP's ``h``) and the lm_head, on the rows that
        need logits."""
        eps = self.config.rms_norm_eps
        if logits_indices is not None:
            h, residual = h[logits_indices], residual[logits_indices]
        x, _ = self.ops.add_rms_norm(h, residual, self.norm, eps)
        logits = self.lm_head(x)
        return logits.float() if float_logits else logits
