"""The inputs of ``kvstack plan``: model shapes and GPU memory, from registries or files.

A model is a registry name (``data/models.json``, or its Hugging Face id), a Hugging Face
``config.json`` (or a folder holding one; the parameter count is estimated from the shapes
when the config has none), a GPU a registry name (``data/gpus.json``) or a per-GPU memory
size. GPU memory follows the data file's convention: a vendor's "80GB" is 80 GiB
(80 × 2^30 bytes). Bad input raises one ``ConfigError`` line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError
from kvstack.core.units import parse_size

GB = 10**9
GiB = 2**30
MiB = 2**20
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5,
}  # fmt: skip
_HF_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes that decide KV and weight memory."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    max_position_embeddings: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    weights_dtype: str = "bf16"
    params_estimated: bool = False

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    memory_bytes: int


def parse_tokens(text: str | int) -> int:
    """``128k`` → 131072 (k = 1024, m = 1024²), or a plain positive integer."""
    s = str(text).strip().lower()
    scale = {"k": 1024, "m": 1024**2}.get(s[-1:], 1)
    try:
        value = int(s[:-1] if scale > 1 else s) * scale
    except ValueError:
        raise ConfigError(f"cannot parse token count {text!r} (examples: 131072, 128k)") from None
    if value <= 0:
        raise ConfigError(f"context must be positive, got {text!r}")
    return value


def _load(name: str) -> dict[str, Any]:
    text = resources.files("kvstack.tools").joinpath("data", name).read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def known_models() -> dict[str, dict[str, Any]]:
    return _load("models.json")


def known_gpus() -> dict[str, dict[str, Any]]:
    return _load("gpus.json")


def check_dtype(name: str, what: str) -> str:
    """``name`` lower-cased if it is a key of :data:`DTYPE_BYTES`, else a ``ConfigError``."""
    d = name.lower()
    if d not in DTYPE_BYTES:
        raise ConfigError(f"unknown {what} {name!r}; choose from {', '.join(DTYPE_BYTES)}")
    return d


def check_positive(value: int | float, what: str) -> None:
    """A ``ConfigError`` naming ``what`` unless ``value`` > 0."""
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {value}")


_REGISTRY_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
    "num_params", "max_position_embeddings",
)  # fmt: skip


def resolve_model(text: str) -> ModelSpec:
    """A registry name (or its Hugging Face id), a config.json path, or a folder holding one."""
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read model config {str(path)!r}: {e}") from None
        return model_from_hf_config(cfg, str(path))
    reg = known_models()
    for key, entry in reg.items():
        if text.lower() in (key, str(entry.get("hf_id", "")).lower()):
            mla = entry.get("mla") or {}
            window = entry.get("sliding_window")
            return ModelSpec(
                name=key,
                **{f: entry[f] for f in _REGISTRY_FIELDS},
                kv_lora_rank=mla.get("kv_lora_rank"),
                qk_rope_head_dim=mla.get("qk_rope_head_dim"),
                sliding_window=window,
                num_sliding_layers=entry.get("num_sliding_layers", entry["num_layers"])
                if window
                else 0,
                weights_dtype=entry.get("weights_dtype", "bf16"),
            )
    if text.endswith(".json") or "/" in text:
        raise ConfigError(f"model config not found: {text!r}; known models: {', '.join(reg)}")
    raise ConfigError(f"unknown model {text!r}; known models: {', '.join(reg)} (or a config.json)")


def _need(cfg: dict[str, Any], key: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"{source}: missing field {key!r} needed by the planner")
    return cfg[key]


def model_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Read a Hugging Face ``config.json`` (text-model fields; ``text_config`` if nested)."""
    cfg = cfg.get("text_config") or cfg
    layers = int(_need(cfg, "num_hidden_layers", source))
    hidden = int(_need(cfg, "hidden_size", source))
    heads = int(_need(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    max_pos = int(_need(cfg, "max_position_embeddings", source))
    for what, v in (("num_hidden_layers", layers), ("hidden_size", hidden), ("heads", heads)):
        check_positive(v, f"{source}: {what}")
    mla = cfg.get("kv_lora_rank") is not None
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    n_sliding = 0
    if window:
        if isinstance(cfg.get("layer_types"), list):
            n_sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
        elif cfg.get("sliding_window_pattern"):  # Gemma-3: every Nth layer is global
            n_sliding = layers - layers // int(cfg["sliding_window_pattern"])
        else:  # Mistral semantics: every layer slides
            n_sliding = layers
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    wdtype = "fp8" if quant == "fp8" else _HF_DTYPES.get(str(cfg.get("torch_dtype")), "bf16")
    params = cfg.get("num_params")
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or source),
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_params=int(params) if params else estimate_params(cfg, source),
        max_position_embeddings=max_pos,
        kv_lora_rank=int(_need(cfg, "kv_lora_rank", source)) if mla else None,
        qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim", source)) if mla else None,
        sliding_window=int(window) if window and n_sliding else None,
        num_sliding_layers=n_sliding,
        weights_dtype=wdtype,
        params_estimated=not params,
    )


def estimate_params(cfg: dict[str, Any], source: str = "config.json") -> int:
    """Parameter count from a decoder's shapes (norms and biases ignored, < 0.1 %).

    Embeddings vocab × hidden (twice unless ``tie_word_embeddings``); attention Q, K, V, O (MLA:
    the low-rank q_a/q_b, kv_a/kv_b and O projections of DeepSeek-V2 §2.1); a gated MLP of
    3 × hidden × intermediate, or for MoE (``num_local_experts`` / ``n_routed_experts`` plus
    ``n_shared_experts``, after ``first_k_dense_replace`` dense layers) that many expert MLPs of
    ``moe_intermediate_size`` plus the router.
    """
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    vocab = int(_need(cfg, "vocab_size", source))
    inter = int(_need(cfg, "intermediate_size", source))
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    if cfg.get("kv_lora_rank") is not None:
        rope, nope = int(cfg["qk_rope_head_dim"]), int(_need(cfg, "qk_nope_head_dim", source))
        v_hd, kv_r = int(_need(cfg, "v_head_dim", source)), int(cfg["kv_lora_rank"])
        q_r = cfg.get("q_lora_rank")
        q = h * heads * (nope + rope) if not q_r else h * q_r + q_r * heads * (nope + rope)
        attn = q + h * (kv_r + rope) + kv_r * heads * (nope + v_hd) + heads * v_hd * h
    else:
        attn = 2 * h * heads * hd + 2 * h * kv_heads * hd
    experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    dense_mlp = 3 * h * inter
    if experts:
        moe_inter = int(cfg.get("moe_intermediate_size") or inter)
        shared = int(cfg.get("n_shared_experts") or 0)
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        moe_mlp = (experts + shared) * 3 * h * moe_inter + h * experts
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp_total = layers * dense_mlp
    return embed + layers * attn + mlp_total


def resolve_gpu(text: str) -> GpuSpec:
    """A registry name (``h100-80gb``) or a per-GPU memory size (``80GiB``, ``141GB``)."""
    reg = known_gpus()
    if text.lower() in reg:
        entry = reg[text.lower()]
        return GpuSpec(text.lower(), entry["name"], int(entry["memory_bytes"]))
    if text[:1].isdigit() or text[:1] == "-":
        try:
            size = parse_size(text)
        except ConfigError as e:
            raise ConfigError(f"bad --gpu {text!r}: {e}") from None
        return GpuSpec(text, f"custom {text}", size)
    raise ConfigError(f"unknown GPU {text!r}; known GPUs: {', '.join(reg)} (or a size like 80GiB)")
