"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``; transformers ``models/qwen2/modeling_qwen2.py``).

Llama plus a bias on the q, k and v projections (never on o_proj, whatever the config
says: ``Qwen2Attention`` builds them so). Its config may declare sliding-window layers:
``use_sliding_window`` true makes layers from ``max_window_layers`` on (or those that
``layer_types`` names ``sliding_attention``) attend to the last ``sliding_window`` keys
only (``Features.window_layers`` says which; ``model/arch/window.py``). llama.cpp writes
``general.architecture = "qwen2"`` GGUFs with q/k rows as Hugging Face has them
(``Qwen2Model`` in ``convert_hf_to_gguf.py`` does not permute; llama.cpp runs qwen2 with
NeoX rotate-half RoPE) and the biases as ``blk.N.attn_{q,k,v}.bias``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstack.core.errors import ModelLoadError
from kvstack.model.arch.base import Architecture, Features, check_window, reject_keys


def layer_types(cfg: Mapping[str, Any], where: Path) -> tuple[bool, ...] | None:
    """``config.json`` ``layer_types`` as sliding (True) per layer, or None if absent."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    known = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or any(t not in known for t in types):
        raise ModelLoadError(f"{where}: invalid layer_types {types!r} (a list of {known})")
    return tuple(t == "sliding_attention" for t in types)


def qwen_window(cfg: Mapping[str, Any], context: int, where: Path) -> Features:
    """The window of a Qwen2/Qwen3 ``config.json`` as transformers' configs decide it
    (``Qwen2Config``: with ``use_sliding_window``, layers from ``max_window_layers`` on
    slide, or those ``layer_types`` names ``sliding_attention``); no window otherwise."""
    if not cfg.get("use_sliding_window"):
        return Features()
    sliding = layer_types(cfg, where)
    if sliding is None:
        try:
            # transformers' Qwen2Config / Qwen3Config default: 28
            first, n = int(cfg.get("max_window_layers", 28)), int(cfg["num_hidden_layers"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ModelLoadError(f"{where}: invalid max_window_layers ({e})") from e
        sliding = tuple(i >= first for i in range(n))
    if not any(sliding):
        return Features()
    window = check_window(cfg.get("sliding_window"), context, where, "sliding_window")
    return Features(sliding_window=window, window_layers=None if window is None else sliding)


class Qwen2(Architecture):
    name = "qwen2"
    hf_classes = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    gguf_names = ("qwen2",)
    summary = "Qwen2, Qwen2.5 (Qwen2ForCausalLM): q/k/v biases"

    def hf_features(self, cfg: Mapping[str, Any], context: int, where: Path) -> Features:
        reject_keys(cfg, ("mlp_bias",), "MLP biases are not supported", where)
        return replace(qwen_window(cfg, context, where), qkv_bias=True)

    def gguf_features(
        self, md: Mapping[str, Any], prefix: str, context: int, where: Path
    ) -> Features:
        return replace(super().gguf_features(md, prefix, context, where), qkv_bias=True)


QWEN2 = Qwen2()
