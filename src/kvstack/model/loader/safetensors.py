"""Hugging Face folder loader: ``config.json`` + ``*.safetensors`` (single or sharded).

Accepted folders hold a checkpoint of a family in ``ARCHITECTURES`` (``model/arch/``:
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``)::

    config.json                          architecture and hyper-parameters
    model.safetensors                    one file, or
    model.safetensors.index.json         {"weight_map": {name: shard file}} + shards

Weights come back as float32 tensors under their Hugging Face names, the same names and
layout the GGUF loader produces, so the rest of kvstack never knows which format it read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvstack.core.errors import ModelLoadError
from kvstack.core.model_config import ModelConfig, RopeScaling
from kvstack.model.arch import arch_for_hf
from kvstack.model.loader.gguf import check_weights, expected_shapes


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of ``folder`` (``ModelLoadError`` when absent or invalid)."""
    root = Path(folder)
    path = root / "config.json"
    if not root.is_dir():
        raise ModelLoadError(f"model folder not found: {root}")
    if not path.is_file():
        raise ModelLoadError(f"{root}: no config.json (not a Hugging Face model folder)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _rope(cfg: dict[str, Any], where: Path) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either the classic keys or ``rope_parameters``."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    scaling = params if params is not None else cfg.get("rope_scaling")
    theta = float((params or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not scaling:
        return theta, None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{where}: invalid rope_scaling {scaling!r} (an object)")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind != "llama3":
        raise ModelLoadError(f"{where}: RoPE scaling type {kind!r} is not supported (only llama3)")
    try:
        return theta, RopeScaling(
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)
            ),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: invalid llama3 rope_scaling {scaling!r}") from e


def _int(cfg: dict[str, Any], key: str, where: Path, family: str, default: int = 0) -> int:
    """``cfg[key]`` as a positive int (``default`` when absent or null, if not 0), or a
    ``ModelLoadError`` naming ``key``."""
    value = cfg.get(key)
    if value is None:
        if default:
            return default
        raise ModelLoadError(f"{where}: config.json lacks {key!r} (needed by {family} models)")
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ModelLoadError(f"{where}: config.json {key}={value!r} is not an integer")
    if value <= 0:
        raise ModelLoadError(f"{where}: config.json {key}={value!r} must be positive")
    return int(value)


def config_from_hf(cfg: dict[str, Any], where: Path, name: str | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from a ``config.json`` dict of any family in
    ``ARCHITECTURES`` (``model/arch/``): the shared keys here, the family's own there."""
    arch = arch_for_hf(cfg, where)
    act = cfg.get(arch.hidden_act_key, arch.hidden_act)
    if act != arch.hidden_act:
        raise ModelLoadError(f"{where}: {arch.hidden_act_key} {act!r} is not supported")

    def size(key: str, default: int = 0) -> int:
        return _int(cfg, key, where, arch.name, default)

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    head_dim = size("head_dim") if arch.needs_head_dim else size("head_dim", hidden // heads)
    context = size("max_position_embeddings", 2048)
    features = arch.hf_features(cfg, context, where)
    try:
        theta, scaling = _rope(cfg, where)
        return ModelConfig(
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=features.rope_theta or theta,
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            architecture=arch.name,
            name=name or str(cfg.get("_name_or_path") or where.name),
            qkv_bias=features.qkv_bias,
            qk_norm=features.qk_norm,
            sliding_window=features.sliding_window,
            window_layers=features.window_layers,
            rope_local_theta=features.rope_local_theta,
            query_pre_attn_scalar=features.query_pre_attn_scalar,
        )
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:  # ConfigError too
        raise ModelLoadError(f"{where}: invalid config.json ({e})") from e


def _shard_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: invalid shard index ({e})") from e
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:  # a file of this folder: "../x" or "/etc/x" would escape it
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise ModelLoadError(f"{index}: shard {name!r} is not a file name in {root}")
        files = [root / f for f in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{root}: missing weight shards {', '.join(missing)}")
        return files
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{root}: no *.safetensors weights found")
    return found


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a checkpoint folder: its ``ModelConfig`` and float32 weights."""
    root = Path(folder)
    cfg = config_from_hf(read_hf_config(root), root)
    wanted = expected_shapes(cfg)
    weights: dict[str, torch.Tensor] = {}
    for file in _shard_files(root):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key in wanted:
                        weights[key] = f.get_tensor(key).to(torch.float32).contiguous()
                    elif key.endswith("rotary_emb.inv_freq") or key == "lm_head.weight":
                        continue  # derived buffer / tied head
                    else:
                        raise ModelLoadError(
                            f"{file}: unexpected tensor {key!r} for a {cfg.architecture} model"
                        )
        except ModelLoadError:
            raise
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({e})") from e
    check_weights(cfg, weights, root)
    return cfg, weights
