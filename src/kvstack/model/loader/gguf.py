"""GGUF loader: weights (dequantized to float32) and a ``ModelConfig`` of any family in
``ARCHITECTURES`` (``model/arch/``: ``general.architecture`` llama, qwen2, qwen3, mistral).

The file is parsed by ``kvstack.model.loader.gguf_reader.GGUFFile`` (header via ``mmap`` +
``struct``, dequantization via ``gguf.quants``); this module maps llama.cpp's tensor names
to Hugging Face names, rebuilds the ``ModelConfig`` from the ``{arch}.*`` metadata (the
family adds its features) and checks that every weight is present with the right shape,
and no other one.

For its ``LLAMA`` arch llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k``
so that each head's RoPE pairs are interleaved (``x[2i], x[2i+1]``); Hugging Face Llama
rotates halves (``x[i], x[i + d/2]``). ``unpermute_qk`` undoes it, ``permute_qk``
re-applies it (for writers). Families written unpermuted (qwen2, qwen3: llama.cpp runs
them with NeoX rotate-half RoPE) say so with ``Architecture.gguf_permuted_qk``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstack.core.errors import ModelLoadError
from kvstack.core.model_config import ModelConfig, RopeScaling
from kvstack.model.arch import ARCHITECTURES, Architecture, arch_for_gguf
from kvstack.model.loader.gguf_reader import (
    GGUF_MAGIC,
    SUPPORTED_TYPES,
    GGUFFile,
    GGUFTensorInfo,
    Q,
)

__all__ = [
    "GGUF_MAGIC",
    "GGUFFile",
    "GGUFTensorInfo",
    "check_weights",
    "config_from_gguf",
    "expected_shapes",
    "gguf_family",
    "hf_name",
    "load_gguf",
    "permute_qk",
    "read_gguf_config",
    "unpermute_qk",
]

# GGUF tensor name (``blk.{i}.<name>.weight|bias``) -> Hugging Face parameter name.
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
IGNORED_TENSORS = ("rope_freqs.weight",)


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF (rotate-half) row order -> llama.cpp (interleaved) row order, as its converter does."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of ``permute_qk``: llama.cpp interleaved rows back to HF rotate-half rows."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def hf_name(gguf_name: str, family: Architecture | None = None) -> str | None:
    """Hugging Face name of a GGUF tensor, or None if it is no weight kvstack knows
    (``family.gguf_layer_names`` first: Gemma 3 names its norms its own way)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[3] in ("weight", "bias")
    ):
        own = family.gguf_layer_names if family is not None else {}
        sub = own.get(parts[2], LAYER_NAMES.get(parts[2]))
        if sub is not None:
            return f"model.layers.{int(parts[1])}.{sub}.{parts[3]}"
    return None


def llama3_freq_factors(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs.weight`` for Llama 3."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wl = s.original_max_position_embeddings / s.low_freq_factor
    high_wl = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, s.factor, mid))


def _fit_llama3_scaling(stored: np.ndarray, head_dim: int, theta: float) -> RopeScaling:
    """Llama-3 scaling parameters that reproduce llama.cpp's ``rope_freqs`` divisors.

    With ``low_freq_factor`` 1 (as in every Llama 3 release) the interpolated band obeys
    ``s = orig / ((high - 1) * wavelen) - 1 / (high - 1)`` where ``1/f = (1 - s)/factor + s``,
    linear in ``1 / wavelen``: two or more band points give ``orig`` and ``high``. Without
    band points Meta's published constants (8192, 1, 4) are assumed; the caller verifies.
    """
    factor = float(stored.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq / (2 * math.pi)  # 1 / wavelength
    f = stored.astype(np.float64)
    band = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if factor <= 1.0 or band.sum() < 2:
        return RopeScaling(factor=factor)
    smooth = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[band], smooth, 1)
    high = 1 - 1 / float(intercept) if intercept < 0 else 4.0
    return RopeScaling(
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=float(round(high, 4)),
        original_max_position_embeddings=round(float(slope) * (high - 1)),
    )


def _rope_scaling(g: GGUFFile, arch: str, head_dim: int, theta: float) -> RopeScaling | None:
    md = g.metadata
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind in ("linear", "yarn", "longrope") and factor != 1.0:
        raise ModelLoadError(f"{g.path}: RoPE scaling type {kind!r} is not supported")
    stored = g.tensor("rope_freqs.weight").numpy() if "rope_freqs.weight" in g.tensors else None
    if kind != "llama3" and stored is None:
        return None
    if kind == "llama3":
        scaling = RopeScaling(
            factor=factor,
            low_freq_factor=float(md.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(md.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                md.get(f"{arch}.rope.scaling.original_context_length", 8192)
            ),
        )
    else:  # only a rope_freqs tensor (what llama.cpp writes): recover the parameters
        assert stored is not None
        scaling = _fit_llama3_scaling(stored, head_dim, theta)
    if stored is not None:
        expected = llama3_freq_factors(head_dim, theta, scaling)
        if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
            raise ModelLoadError(
                f"{g.path}: rope_freqs.weight does not match Llama-3 RoPE scaling; unsupported"
            )
    return scaling


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """Build a ``ModelConfig`` from a parsed GGUF's ``{arch}.*`` metadata and tensor shapes."""
    md = g.metadata
    family = arch_for_gguf(md.get("general.architecture"), g.path)
    arch = str(md["general.architecture"])  # the metadata prefix

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{g.path}: missing metadata key {arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"{g.path}: per-layer {arch}.{key} is not supported")
        return value

    if "token_embd.weight" not in g.tensors:
        raise ModelLoadError(f"{g.path}: missing tensor token_embd.weight")
    try:
        hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(md.get(f"{arch}.attention.key_length", hidden // n_heads))
        rope_dim = int(md.get(f"{arch}.rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ModelLoadError(f"{g.path}: partial RoPE ({rope_dim} of {head_dim}) not supported")
        theta = float(get("rope.freq_base", 10000.0))
        context = int(get("context_length", 2048))
        features = family.gguf_features(md, arch, context, g.path)
        return ModelConfig(
            vocab_size=g.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=n_heads,
            num_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=features.rope_theta or theta,
            rope_scaling=_rope_scaling(g, arch, head_dim, theta),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in g.tensors,
            architecture=family.name,
            name=str(md.get("general.name", g.path.stem)),
            qkv_bias=features.qkv_bias,
            qk_norm=features.qk_norm,
            sliding_window=features.sliding_window,
            window_layers=features.window_layers,
            rope_local_theta=features.rope_local_theta,
            query_pre_attn_scalar=features.query_pre_attn_scalar,
        )
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        raise ModelLoadError(f"{g.path}: invalid model metadata: {e}") from e


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF weight name a model with ``cfg`` needs, with its shape (the features add
    q/k/v biases, ``qkv_bias``, and per-head q/k norm weights, ``qk_norm``)."""
    h, q, kv, i = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    per_layer = {
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    if cfg.qk_norm:
        per_layer.update({"self_attn.q_norm": (cfg.head_dim,), "self_attn.k_norm": (cfg.head_dim,)})
    per_layer.update({norm: (h,) for norm in ARCHITECTURES.get(cfg.architecture).extra_layer_norms})
    biases = {"self_attn.q_proj": (q,), "self_attn.k_proj": (kv,), "self_attn.v_proj": (kv,)}
    for layer in range(cfg.num_layers):
        for sub, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{sub}.weight"] = shape
        for sub, shape in biases.items() if cfg.qkv_bias else ():
            shapes[f"model.layers.{layer}.{sub}.bias"] = shape
    return shapes


def check_weights(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    where: Path,
    skipped: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Raise ``ModelLoadError`` if a weight is missing or has the wrong shape (``skipped``:
    the shapes of weights not read as floats)."""
    expected = expected_shapes(cfg)
    shapes = {n: tuple(t.shape) for n, t in weights.items()} | dict(skipped or {})
    missing = [n for n in expected if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{where}: missing tensors {', '.join(missing[:3])}{more}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ModelLoadError(
                f"{where}: tensor {name} has shape {shapes[name]}, expected {shape}"
            )


def load_gguf(
    path: str | Path,
    *,
    num_threads: int | None = None,
    skip: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a GGUF: its ``ModelConfig`` and float32 weights under Hugging Face names.

    ``skip`` (HF name -> shape): weights the caller has in another form (kept packed) and
    that are not dequantized; their shapes are still checked."""
    with GGUFFile.open(path) as g:
        cfg = config_from_gguf(g)
        wanted = expected_shapes(cfg)
        family = gguf_family(cfg)
        names: dict[str, str] = {}
        for name in g.tensors:
            target = hf_name(name, family)
            if target is None or target not in wanted:
                if name in IGNORED_TENSORS or name.endswith(".attn_rot_embd"):
                    continue
                raise ModelLoadError(
                    f"{g.path}: unexpected tensor {name!r} (not a {cfg.architecture} weight)"
                )
            names[name] = target
        for name in names:
            qtype = Q(g.tensors[name].qtype)
            if qtype not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{g.path}: tensor {name!r} has unsupported quantization type {qtype.name}"
                )

        permuted, offset = family.gguf_permuted_qk, family.gguf_norm_offset

        def convert(name: str) -> tuple[str, torch.Tensor]:
            w = g.tensor(name)
            if permuted and name.endswith((".attn_q.weight", ".attn_q.bias")):
                w = unpermute_qk(w, cfg.num_heads).contiguous()
            elif permuted and name.endswith((".attn_k.weight", ".attn_k.bias")):
                w = unpermute_qk(w, cfg.num_kv_heads).contiguous()
            if offset and name.endswith("norm.weight"):  # llama.cpp stored Gemma's 1 + w
                w = w - offset
            return names[name], w

        # numpy's dequantization releases the GIL for large arrays: threads help.
        skip = skip or {}
        order = sorted(
            (n for n in names if names[n] not in skip), key=lambda n: -g.tensors[n].nbytes
        )
        workers = num_threads or min(4, os.cpu_count() or 1)
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                weights = dict(pool.map(convert, order))
        except (ValueError, TypeError, RuntimeError) as e:
            raise ModelLoadError(f"{g.path}: cannot decode tensor data ({e})") from e
    check_weights(cfg, weights, Path(path), skip)
    return cfg, weights


def gguf_family(cfg: ModelConfig) -> Architecture:
    """The family of a loaded config (whether its GGUF q/k rows are permuted)."""
    return ARCHITECTURES.get(cfg.architecture)


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Only the ``ModelConfig`` of a GGUF (no tensor data is read)."""
    with GGUFFile.open(path) as g:
        return config_from_gguf(g)
