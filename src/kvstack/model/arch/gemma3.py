"""Gemma 3, text only (``Gemma3ForCausalLM``; transformers ``models/gemma3/modeling_gemma3.py``).

What differs from Llama (the forward: ``model/arch/gemma3_decoder.py``):

- local and global layers interleave: layers ``layer_types`` names ``sliding_attention``
  attend to the last ``sliding_window`` keys (``model/arch/window.py``), the others to all;
  without ``layer_types`` every ``sliding_window_pattern``-th layer (default 6) is global,
  as ``Gemma3TextConfig`` decides;
- two RoPE bases: ``rope_local_base_freq`` (10k) on local layers, ``rope_theta`` (1M) on
  global ones (transformers 5 writes both as ``rope_parameters.{sliding,full}_attention``);
  RoPE scaling (the 4B+ releases' linear factor 8 on global layers) is refused;
- per-head q/k RMSNorm, ``query_pre_attn_scalar ** -0.5`` as the attention scale, Gemma
  RMSNorm ``x * (1 + w)``, GeGLU with tanh-GELU, sandwich norms, embeddings scaled by
  ``sqrt(hidden)``;
- softcapping (``attn_logit_softcapping``, ``final_logit_softcapping``) and bidirectional
  attention are refused (Gemma 3 sets neither).

llama.cpp's converter (``Gemma3Model`` in ``convert_hf_to_gguf.py``) writes
``general.architecture = "gemma3"``, q/k rows unpermuted (llama.cpp runs Gemma with NeoX
RoPE), every ``*norm.weight`` as ``1 + w`` (``gguf_norm_offset``: the loader subtracts it
back, as transformers' GGUF reader does) and the norms under its own names
(``gguf_layer_names``). Its metadata has no pattern nor local base: llama.cpp hard-codes
both (every 6th layer global, local base 10,000) and the scale ``head_dim ** -0.5``
(``hidden / heads`` for the 62-layer 27B), which the GGUF features repeat.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from kvstack.core.errors import ModelLoadError
from kvstack.model.arch.base import Architecture, Features, check_window, reject_keys
from kvstack.model.arch.qwen2 import layer_types

LOCAL_THETA = 10000.0
PATTERN = 6


def _pattern_layers(n: int, pattern: object, where: Path) -> tuple[bool, ...]:
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ModelLoadError(f"{where}: invalid sliding_window_pattern {pattern!r}")
    return tuple((i + 1) % pattern != 0 for i in range(n))


def _rope_params(cfg: Mapping[str, Any], kind: str, where: Path) -> Mapping[str, Any]:
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        return {}
    sub = params.get(kind)
    if not isinstance(sub, dict):
        raise ModelLoadError(f"{where}: invalid rope_parameters.{kind} {sub!r} (an object)")
    if sub.get("rope_type", "default") != "default":
        raise ModelLoadError(
            f"{where}: rope_parameters.{kind} RoPE scaling {sub.get('rope_type')!r} is not "
            "supported for gemma3"
        )
    return sub


def _float(value: object, key: str, where: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ModelLoadError(f"{where}: invalid {key} {value!r} (a positive number)")
    return float(value)


class Gemma3(Architecture):
    name = "gemma3"
    hf_classes = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    gguf_names = ("gemma3",)
    needs_head_dim = True
    gguf_norm_offset = 1.0
    gguf_layer_names: ClassVar[Mapping[str, str]] = {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    extra_layer_norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    hidden_act_key = "hidden_activation"
    hidden_act = "gelu_pytorch_tanh"
    summary = "Gemma 3 text (Gemma3ForCausalLM): local/global layers, q/k norms, GeGLU"

    def hf_features(self, cfg: Mapping[str, Any], context: int, where: Path) -> Features:
        reject_keys(
            cfg,
            ("attn_logit_softcapping", "final_logit_softcapping", "attention_bias"),
            "not supported for gemma3",
            where,
        )
        reject_keys(
            cfg, ("use_bidirectional_attention",), "bidirectional attention is not supported",
            where,
        )  # fmt: skip
        if cfg.get("rope_scaling"):
            raise ModelLoadError(f"{where}: gemma3 RoPE scaling is not supported")
        n = cfg.get("num_hidden_layers")
        sliding = layer_types(cfg, where)
        if sliding is None and isinstance(n, int):
            sliding = _pattern_layers(n, cfg.get("sliding_window_pattern", PATTERN), where)
        full, local = (_rope_params(cfg, k, where) for k in ("full_attention", "sliding_attention"))
        theta = full.get("rope_theta", cfg.get("rope_theta", 1000000.0))
        local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", LOCAL_THETA))
        scalar = cfg.get("query_pre_attn_scalar", 256)
        return Features(
            qk_norm=True,
            sliding_window=check_window(
                cfg.get("sliding_window"), context, where, "sliding_window"
            ),
            window_layers=sliding,
            rope_theta=_float(theta, "rope_theta", where),
            rope_local_theta=_float(local_theta, "rope_local_base_freq", where),
            query_pre_attn_scalar=_float(scalar, "query_pre_attn_scalar", where),
        )

    def gguf_features(
        self, md: Mapping[str, Any], prefix: str, context: int, where: Path
    ) -> Features:
        window = super().gguf_features(md, prefix, context, where).sliding_window
        n = int(md.get(f"{prefix}.block_count", 0))
        hidden = int(md.get(f"{prefix}.embedding_length", 0))
        heads = max(1, int(md.get(f"{prefix}.attention.head_count", 1)))
        head_dim = int(md.get(f"{prefix}.attention.key_length", hidden // heads))
        # llama.cpp: the 27B (62 layers) scales by hidden / heads, the others by head_dim
        scalar = hidden // heads if n == 62 else head_dim
        return Features(
            qk_norm=True,
            sliding_window=window,
            window_layers=_pattern_layers(n, PATTERN, where),
            rope_local_theta=LOCAL_THETA,
            query_pre_attn_scalar=float(scalar) if scalar > 0 else None,
        )


GEMMA3 = Gemma3()
