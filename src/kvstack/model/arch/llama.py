"""Llama (``LlamaForCausalLM``; transformers ``models/llama/modeling_llama.py``).

The reference family: no biases, no q/k norms, no sliding window. llama.cpp's converter
writes its GGUFs as ``general.architecture = "llama"`` with the q/k rows permuted for
interleaved RoPE (``model/loader/gguf.py`` ``unpermute_qk`` undoes it); it writes Mistral
checkpoints the same way, so a Mistral GGUF from llama.cpp loads as this family.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstack.model.arch.base import Architecture, Features, reject_keys


class Llama(Architecture):
    name = "llama"
    hf_classes = ("LlamaForCausalLM",)
    model_types = ("llama",)
    gguf_names = ("llama",)
    gguf_permuted_qk = True
    summary = "Llama 2/3, SmolLM (LlamaForCausalLM)"

    def hf_features(self, cfg: Mapping[str, Any], context: int, where: Path) -> Features:
        reject_keys(
            cfg, ("attention_bias", "mlp_bias"), "attention/MLP biases are not supported", where
        )
        return Features()


LLAMA = Llama()
