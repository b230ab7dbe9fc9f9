"""Tiny random models of every family in ``model/arch/``, saved by transformers itself.

``tiny_family_config(arch)`` sizes a 2-layer model of that family (each with something its
family has and Llama lacks: Qwen2 q/k/v biases, Qwen3 q/k norms and a ``head_dim`` of 64
in a 64-wide model, Mistral a ``sliding_window`` that covers the context);
``write_transformers_folder`` builds transformers' own ``*ForCausalLM`` from that config,
loads ``random_llama_weights`` into it and ``save_pretrained``s it with the minimal
tokenizer, so kvstack reads the ``config.json`` and safetensors names transformers
writes. ``hf_greedy`` is the reference: a plain greedy loop over transformers' forward
with its KV cache (no logits processors), with the top-2 gap of each step.
``paged_logits`` runs a kvstack model over a prompt in chunks on a shuffled block table.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvstack.core.model_config import ModelConfig
from kvstack.kv.storage import KVStorage
from kvstack.model.arch.decoder import LlamaModel
from kvstack.model.attention import AttentionMetadata, PrefillSeq
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.testing.tiny_models import (
    hf_config_dict,
    minimal_tokenizer_metadata,
    tiny_llama_config,
)

FAMILY_FEATURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"qkv_bias": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "qwen3": {"qk_norm": True, "head_dim": 64, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "mistral": {"sliding_window": 512},
}


def tiny_family_config(arch: str, **overrides: Any) -> ModelConfig:
    """A 2-layer, 64-wide, 4-head (2 KV heads) model of family ``arch``, vocab 320,
    context 512, untied lm_head, with the family's own features."""
    base = tiny_llama_config(
        architecture=arch, name=f"tiny-{arch}", tie_word_embeddings=False, vocab_size=320
    )
    return replace(base, **{**FAMILY_FEATURES[arch], **overrides})


def transformers_model(config: ModelConfig, weights: dict[str, torch.Tensor]) -> Any:
    """transformers' ``*ForCausalLM`` of ``config``'s family holding ``weights``, fp32, eval."""
    import transformers

    d = hf_config_dict(config)
    d.pop("torch_dtype")
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    model.generation_config.eos_token_id = None
    return model.eval()


def write_transformers_folder(path: Path, model: Any, vocab_size: int) -> Path:
    """``model.save_pretrained(path)`` (safetensors) plus the minimal tokenizer."""
    model.save_pretrained(str(path))
    Tokenizer.from_gguf_metadata(minimal_tokenizer_metadata(vocab_size)).save_pretrained(path)
    return path


def hf_greedy(model: Any, ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """(greedy tokens, top-2 logit gap of each step) of transformers' ``model``."""
    tokens: list[int] = []
    gaps: list[float] = []
    past = None
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            top2 = out.logits[0, -1].float().topk(2)
            tokens.append(int(top2.indices[0]))
            gaps.append(float(top2.values[0] - top2.values[1]))
            x = torch.tensor([[tokens[-1]]])
    return tokens, gaps


SHUFFLED_BLOCKS = [7, 3, 9, 1, 12, 5, 0, 2]  # logical order != physical order
BLOCK_SIZE = 4


def _meta(positions: range, prefill: PrefillSeq | None, kernels: bool) -> AttentionMetadata:
    bs, blocks = BLOCK_SIZE, SHUFFLED_BLOCKS
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in positions])
    if prefill is not None:
        return AttentionMetadata(slots, 0, None, None, None, [prefill])
    n = positions.stop
    bias = torch.zeros(1, len(blocks) * bs)
    bias[0, n:] = float("-inf")
    return AttentionMetadata(
        slots, 1, torch.tensor([blocks]), torch.tensor([n]), bias[:, None, None, :], [],
        kernels=load_kernels() if kernels else None,
    )  # fmt: skip


def paged_logits(
    model: LlamaModel, ids: torch.Tensor, chunks: list[int], kernels: bool
) -> torch.Tensor:
    """Logits of ``ids`` fed as prefill chunks of ``chunks`` tokens, then one decode step
    per remaining token, on a fresh cache with a shuffled block table (up to 32 tokens)."""
    kv = KVStorage(model.config, 16, BLOCK_SIZE, model.dtype)
    out, start = [], 0
    for n in chunks:
        end = start + n
        prior = torch.tensor(SHUFFLED_BLOCKS) if start else None
        mask = torch.arange(end)[None] <= torch.arange(start, end)[:, None] if start else None
        meta = _meta(range(start, end), PrefillSeq(0, n, end, prior, mask), kernels)
        out.append(model.forward(ids[start:end], torch.arange(start, end), meta, kv, None))
        start = end
    for p in range(start, len(ids)):
        meta = _meta(range(p, p + 1), None, kernels)
        out.append(model.forward(ids[p : p + 1], torch.tensor([p]), meta, kv, None))
    return torch.cat(out)
