"""Tiny random Gemma 3 text models, built by transformers' own ``Gemma3ForCausalLM``.

``tiny_gemma3_config`` sizes a 3-layer model (two local layers with a window of 8 and
RoPE base 10k, one global layer with base 1M), 64 wide, 2 heads of ``head_dim`` 256 over
one KV head, ``query_pre_attn_scalar`` 64 (so the scale is not ``head_dim``'s), tied
embeddings; ``gemma3_hf_config`` is the ``Gemma3TextConfig`` dict transformers 5 writes
for it (``layer_types``, ``rope_parameters`` per layer type). ``random_gemma3_weights``
draws the norm weights around 0 (Gemma scales by ``1 + w``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from kvstack.core.model_config import ModelConfig
from kvstack.model.loader.gguf import expected_shapes


def tiny_gemma3_config(**overrides: Any) -> ModelConfig:
    base = ModelConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        architecture="gemma3",
        name="tiny-gemma3",
        qk_norm=True,
        sliding_window=8,
        window_layers=(True, True, False),
        rope_local_theta=10000.0,
        query_pre_attn_scalar=64.0,
    )
    return replace(base, **overrides)


def gemma3_hf_config(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``config`` as transformers' ``Gemma3TextConfig`` reads it."""
    layers = config.window_layers or (True,) * config.num_layers
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(config.query_pre_attn_scalar or config.head_dim),
        "sliding_window": config.sliding_window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in layers],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta},
        },
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


def random_gemma3_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under Hugging Face names: linears N(0, 1/in), the embedding
    N(0, 1/hidden), norm weights N(0, 0.1^2) (Gemma's ``1 + w`` makes them ~1)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            w = 0.1 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            w = torch.randn(shape, generator=gen) / math.sqrt(config.hidden_size)
        else:
            w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        out[name] = w
    return out


def transformers_gemma3(config: ModelConfig, weights: dict[str, torch.Tensor]) -> Any:
    """transformers' ``Gemma3ForCausalLM`` of ``config`` holding ``weights``, fp32, eval."""
    import transformers

    d = gemma3_hf_config(config)
    d.pop("architectures")
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise ValueError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    model.generation_config.eos_token_id = None
    return model.eval()
