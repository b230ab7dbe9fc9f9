"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``; transformers ``models/qwen2/modeling_qwen2.py``).

Llama plus a bias on the q, k and v projections (never on o_proj, whatever the config
says: ``Qwen2Attention`` builds them so). Its config may declare sliding-window layers:
``use_sliding_window`` true makes layers from ``max_window_layers`` on (or those that
``layer_types`` names ``sliding_attention``) attend to the last ``sliding_window`` keys
only, which kvstack refuses unless the window covers the whole context. llama.cpp writes
``general.architecture = "qwen2"`` GGUFs with q/k rows as Hugging Face has them
(``Qwen2Model`` in ``convert_hf_to_gguf.py`` does not permute; llama.cpp runs qwen2 with
NeoX rotate-half RoPE) and the biases as ``blk.N.attn_{q,k,v}.bias``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstack.errors import ModelLoadError
from kvstack.model.arch.base import Architecture, Features, check_window, reject_keys


def qwen_window(cfg: Mapping[str, Any], context: int, where: Path) -> int | None:
    """The window of a Qwen2/Qwen3 ``config.json`` as transformers' configs decide it:
    None unless ``use_sliding_window`` and at least one layer is a sliding one."""
    if not cfg.get("use_sliding_window"):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ModelLoadError(f"{where}: invalid layer_types {layer_types!r} (a list)")
        sliding = "sliding_attention" in layer_types
    else:
        try:
            first = int(cfg.get("max_window_layers", 0))
            sliding = first < int(cfg["num_hidden_layers"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ModelLoadError(f"{where}: invalid max_window_layers ({e})") from e
    return (
        check_window(cfg.get("sliding_window"), context, where, "sliding_window")
        if sliding
        else None
    )


class Qwen2(Architecture):
    name = "qwen2"
    hf_classes = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)
    gguf_names = ("qwen2",)
    summary = "Qwen2, Qwen2.5 (Qwen2ForCausalLM): q/k/v biases"

    def hf_features(self, cfg: Mapping[str, Any], context: int, where: Path) -> Features:
        reject_keys(cfg, ("mlp_bias",), "MLP biases are not supported", where)
        return Features(qkv_bias=True, sliding_window=qwen_window(cfg, context, where))

    def gguf_features(
        self, md: Mapping[str, Any], prefix: str, context: int, where: Path
    ) -> Features:
        window = super().gguf_features(md, prefix, context, where).sliding_window
        return Features(qkv_bias=True, sliding_window=window)


QWEN2 = Qwen2()
