"""Mistral (``MistralForCausalLM``; transformers ``models/mistral/modeling_mistral.py``).

The Llama layout; what differs is ``sliding_window``: Mistral-7B v0.1 attends to the last
4,096 keys only (every layer; ``model/arch/window.py``), later releases set it to null (full
attention). A null window, or one covering the whole context, is the Llama forward
exactly. The hybrid KV manager (``kv/hybrid.py``) frees the KV of keys older than the window.
llama.cpp writes Mistral GGUFs as ``general.architecture = "llama"`` (the llama family);
``"mistral"`` is accepted too, permuted as llama.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstack.model.arch.base import Architecture, Features, check_window, reject_keys


class Mistral(Architecture):
    name = "mistral"
    hf_classes = ("MistralForCausalLM",)
    model_types = ("mistral",)
    gguf_names = ("mistral",)
    gguf_permuted_qk = True
    summary = "Mistral 7B (MistralForCausalLM): sliding-window attention"

    def hf_features(self, cfg: Mapping[str, Any], context: int, where: Path) -> Features:
        reject_keys(
            cfg, ("attention_bias", "mlp_bias"), "attention/MLP biases are not supported", where
        )
        window = check_window(cfg.get("sliding_window"), context, where, "sliding_window")
        return Features(sliding_window=window)


MISTRAL = Mistral()
