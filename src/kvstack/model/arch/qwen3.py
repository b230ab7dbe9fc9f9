"""Qwen3 (``Qwen3ForCausalLM``; transformers ``models/qwen3/modeling_qwen3.py``).

Llama plus a per-head RMSNorm on q and on k before RoPE (``q_norm`` / ``k_norm``:
``head_dim`` weights each, the model's ``rms_norm_eps``), and an explicit ``head_dim``
that may differ from ``hidden_size / num_attention_heads`` (Qwen3-0.6B: 1024 wide, 16
heads of 128). ``config.json`` must say ``head_dim``: transformers' default for a missing
one is 128, not ``hidden / heads``, so guessing would load another model. Biases
(``attention_bias``, on q/k/v *and* o_proj) are refused; Qwen3 releases have none.
Windows as Qwen2 (``qwen2.qwen_window``). llama.cpp writes ``general.architecture =
"qwen3"`` GGUFs unpermuted, the norms as ``blk.N.attn_{q,k}_norm.weight`` and the head
size as ``qwen3.attention.key_length``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstack.model.arch.base import Architecture, Features, reject_keys
from kvstack.model.arch.qwen2 import qwen_window


class Qwen3(Architecture):
    name = "qwen3"
    hf_classes = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    gguf_names = ("qwen3",)
    needs_head_dim = True
    summary = "Qwen3 dense (Qwen3ForCausalLM): per-head q/k RMSNorm, explicit head_dim"

    def hf_features(self, cfg: Mapping[str, Any], context: int, where: Path) -> Features:
        reject_keys(
            cfg,
            ("attention_bias", "mlp_bias"),
            "Qwen3 with biases (o_proj included) is not supported",
            where,
        )
        return replace(qwen_window(cfg, context, where), qk_norm=True)

    def gguf_features(
        self, md: Mapping[str, Any], prefix: str, context: int, where: Path
    ) -> Features:
        return replace(super().gguf_features(md, prefix, context, where), qk_norm=True)


QWEN3 = Qwen3()
