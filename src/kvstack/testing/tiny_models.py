"""Tiny random Llama models written as real GGUF files and Hugging Face folders, for tests.

Nothing is downloaded: a test builds a ``tiny_llama_config()``, draws
``random_llama_weights()`` and writes them with ``write_gguf`` / ``write_hf_folder``; the
loaders must then read back exactly (F32) or closely (quantized) the same tensors.

Tokenizers: with ``tokenizer_from`` (a GGUF such as the default model's) its tokenizer
metadata is copied and the config's vocabulary must have the same size (49152 for SmolLM2).
Without it a minimal byte-level tokenizer is written: three ChatML specials, the 256 byte
tokens and reserved control tokens up to ``vocab_size`` (at least 259), no merges.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from kvstack.core.model_config import ModelConfig
from kvstack.model.arch import ARCHITECTURES
from kvstack.model.loader.gguf import (
    GLOBAL_NAMES,
    LAYER_NAMES,
    GGUFFile,
    expected_shapes,
    llama3_freq_factors,
    permute_qk,
)
from kvstack.model.tokenizer.tokenizer import Tokenizer, bytes_to_unicode

MINIMAL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A few English merges (byte-level spelling, "Ġ" is a space) so the minimal BPE merges something.
_MINIMAL_MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("Ġt", "he"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("Ġ", "a"),
    ("r", "e"),
    ("e", "n"),
    ("Ġ", "s"),
    ("Ġ", "w"),
    ("a", "t"),
    ("o", "r"),
]
WRITABLE_TYPES = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
    "Q5_1": gguf.GGMLQuantizationType.Q5_1,
    "Q4_K": gguf.GGMLQuantizationType.Q4_K,
}
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}


def quantize_q4_k(arr: np.ndarray) -> np.ndarray:
    """``[N, K]`` float32 (``K % 256 == 0``) -> llama.cpp Q4_K bytes ``[N, K / 256 * 144]``.

    A plain min/max quantizer (gguf-py has none for Q4_K; llama.cpp's searches the scales):
    per 32-weight sub-block ``scale = (max - min) / 15`` with ``min <= 0``; the super-block's
    ``d`` / ``dmin`` are the largest of them over 63 (fp16), the 6-bit ``sc`` / ``m`` their
    ratios, packed as ``get_scale_min_k4`` reads them.
    """
    n, k = arr.shape
    x = arr.astype(np.float32).reshape(n, k // 256, 8, 32)
    mn = np.minimum(x.min(axis=-1), 0.0)
    span = (x.max(axis=-1) - mn) / 15.0
    d = (span.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (-mn.min(axis=-1) / 63.0).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(span / np.where(df > 0, df, 1)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-mn / np.where(dmf > 0, dmf, 1)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.round((x + (dmf * m)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, k // 256, 4, 2, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    scales = np.concatenate(
        [
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)
    head = np.stack([d, dmin], axis=-1).view(np.uint8).reshape(n, k // 256, 4)
    return np.concatenate([head, scales, qs], axis=-1).reshape(n, -1)


def tiny_llama_config(**overrides: Any) -> ModelConfig:
    """A 2-layer, 64-wide GQA Llama (4 query heads, 2 KV heads, head_dim 16, vocab 320)."""
    base = ModelConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        name="tiny-llama",
    )
    return replace(base, **overrides)


def random_llama_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under Hugging Face names, scaled so activations stay O(1).

    Linear layers are N(0, 1/in_features), embeddings N(0, 1/hidden) (so tied logits have
    unit spread after the final norm), norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2).
    """
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".bias"):
            w = 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name or name == "lm_head.weight":
            w = torch.randn(shape, generator=gen) / math.sqrt(config.hidden_size)
        else:
            w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        weights[name] = w.to(torch.float32)
    return weights


def minimal_tokenizer_metadata(vocab_size: int) -> dict[str, Any]:
    """GGUF ``tokenizer.*`` metadata of a merge-free byte-level BPE with ``vocab_size`` ids."""
    n_fixed = len(MINIMAL_SPECIALS) + 256
    if vocab_size < n_fixed:
        raise ValueError(f"a minimal byte-level tokenizer needs vocab_size >= {n_fixed}")
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    merges = [f"{a} {b}" for a, b in _MINIMAL_MERGES[: vocab_size - n_fixed]]
    merged = [m.replace(" ", "") for m in merges]
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - n_fixed - len(merges))]
    tokens = [*MINIMAL_SPECIALS, *byte_tokens, *merged, *reserved]
    types = [3] * len(MINIMAL_SPECIALS) + [1] * (256 + len(merged)) + [3] * len(reserved)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        **({"tokenizer.ggml.merges": merges} if merges else {}),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


def _tokenizer_metadata(
    config: ModelConfig, tokenizer_from: Path | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, value types) of the tokenizer to embed: copied or minimal."""
    if tokenizer_from is None:
        md = minimal_tokenizer_metadata(config.vocab_size)
        return md, {}
    with GGUFFile.open(tokenizer_from) as g:
        md = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
        types = {k: g.value_types[k] for k in md}
    n = len(md.get("tokenizer.ggml.tokens", []))
    if n != config.vocab_size:
        raise ValueError(
            f"tokenizer of {tokenizer_from} has {n} tokens; config says {config.vocab_size}"
        )
    return md, types


def gguf_name(hf: str, own: Mapping[str, str] | None = None) -> str:
    """GGUF tensor name of a Hugging Face weight name (``own``: the family's names)."""
    for g_name, h_name in GLOBAL_NAMES.items():
        if hf == h_name:
            return g_name
    parts = hf.split(".")  # model.layers.{i}.{sub...}.weight|bias
    sub = ".".join(parts[3:-1])
    for g_sub, h_sub in [*(own or {}).items(), *LAYER_NAMES.items()]:
        if h_sub == sub:
            return f"blk.{parts[2]}.{g_sub}.{parts[-1]}"
    raise KeyError(hf)


def write_gguf(
    path: str | Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer_from: Path | None = None,
    dtype: str = "F32",
    *,
    architecture: str | None = None,
    embedding_dtype: str | None = None,
    rope_scaling_keys: bool = True,
) -> Path:
    """Write ``weights`` as a GGUF of ``architecture`` (default ``config.architecture``)
    the way llama.cpp's converter would.

    2-D weights are stored as ``dtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
    Q4_K: rows of a multiple of 256), the
    embedding as ``embedding_dtype`` (default ``dtype``), norms and biases as F32; q/k rows
    are permuted to llama.cpp's interleaved RoPE layout for the families it permutes
    (llama, mistral; not qwen2, qwen3: ``Architecture.gguf_permuted_qk``). Llama-3 RoPE
    scaling is written as llama.cpp does (a ``rope_freqs.weight`` tensor) plus, unless
    ``rope_scaling_keys`` is False, ``{arch}.rope.scaling.*`` keys. Returns ``path``.
    """
    path = Path(path)
    arch = architecture or config.architecture
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(config.name)
    w.add_file_type(int(_FILE_TYPES.get(dtype, gguf.LlamaFileType.ALL_F32)))
    for key, value in (
        ("block_count", config.num_layers),
        ("context_length", config.max_position_embeddings),
        ("embedding_length", config.hidden_size),
        ("feed_forward_length", config.intermediate_size),
        ("attention.head_count", config.num_heads),
        ("attention.head_count_kv", config.num_kv_heads),
        ("rope.dimension_count", config.head_dim),
        ("vocab_size", config.vocab_size),
    ):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    if config.sliding_window is not None:  # per-layer patterns are the family's
        w.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    if config.head_dim * config.num_heads != config.hidden_size:
        w.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        w.add_uint32(f"{arch}.attention.value_length", config.head_dim)
    if (rs := config.rope_scaling) is not None and rope_scaling_keys:
        w.add_string(f"{arch}.rope.scaling.type", rs.rope_type)
        w.add_float32(f"{arch}.rope.scaling.factor", rs.factor)
        w.add_float32(f"{arch}.rope.scaling.low_freq_factor", rs.low_freq_factor)
        w.add_float32(f"{arch}.rope.scaling.high_freq_factor", rs.high_freq_factor)
        w.add_uint32(
            f"{arch}.rope.scaling.original_context_length", rs.original_max_position_embeddings
        )
    if (rs := config.rope_scaling) is not None:
        freqs = llama3_freq_factors(config.head_dim, config.rope_theta, rs).astype(np.float32)
        w.add_tensor("rope_freqs.weight", freqs)

    md, types = _tokenizer_metadata(config, tokenizer_from)
    for key, value in md.items():
        if key in types:
            vtype, sub = types[key]
            w.add_key_value(key, value, vtype, sub_type=sub)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key == "tokenizer.ggml.token_type":
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            w.add_key_value(
                key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING
            )

    family = ARCHITECTURES.get(arch) if arch in ARCHITECTURES.names() else None
    permuted = family.gguf_permuted_qk if family is not None else True
    own = family.gguf_layer_names if family is not None else {}
    for name, tensor in weights.items():
        t = tensor.detach().to(torch.float32)
        if family is not None and name.endswith("norm.weight"):  # Gemma: 1 + w
            t = t + family.gguf_norm_offset
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute_qk(t, config.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_qk(t, config.num_kv_heads)
        arr = t.contiguous().numpy()
        kind = (embedding_dtype or dtype) if "embed_tokens" in name else dtype
        qtype = WRITABLE_TYPES[kind] if arr.ndim == 2 else gguf.GGMLQuantizationType.F32
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name, own), arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name, own), arr.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.Q4_K:
            w.add_tensor(gguf_name(name, own), quantize_q4_k(arr), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name, own), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict matching ``config`` for its family's transformers class."""
    family = ARCHITECTURES.get(config.architecture)
    d: dict[str, Any] = {
        "architectures": [family.hf_classes[0]],
        "model_type": family.model_types[0],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": asdict(config.rope_scaling) if config.rope_scaling else None,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "_name_or_path": config.name,
    }
    if config.architecture in ("qwen2", "qwen3"):
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
        if config.sliding_window is not None:  # window_layers: which layers slide
            slides = config.window_layers or (True,) * config.num_layers
            types = ["sliding_attention" if s else "full_attention" for s in slides]
            d.update(use_sliding_window=True, sliding_window=config.sliding_window)
            d.update(layer_types=types)
        del d["mlp_bias"]
    if config.architecture in ("qwen2", "mistral"):
        d.pop("attention_bias")
    if config.architecture == "mistral":
        d.update(sliding_window=config.sliding_window)
    return d


def write_hf_folder(
    path: str | Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer_from: Path | None = None,
    *,
    num_shards: int = 1,
) -> Path:
    """Write a Hugging Face folder: ``config.json``, safetensors weights, tokenizer files.

    ``num_shards > 1`` splits the weights over several files with an index JSON. The
    tokenizer is rebuilt from ``tokenizer_from`` (a GGUF) or is the minimal one.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(config)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in weights.items()}
    if num_shards <= 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(tensors)
        weight_map = {}
        for s in range(num_shards):
            fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::num_shards]}
            save_file(part, str(root / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer_from is None:
        tok = Tokenizer.from_gguf_metadata(minimal_tokenizer_metadata(config.vocab_size))
    else:
        tok = Tokenizer.from_gguf(tokenizer_from)
    tok.save_pretrained(root)
    return root
