"""Checkpoints of the model families that kvstack cannot serve as their reference does:
one ``ModelLoadError`` naming the field, never a traceback from deeper down."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from kvstack.core.errors import ModelLoadError
from kvstack.core.model_config import ModelConfig
from kvstack.model.arch import ARCHITECTURES
from kvstack.model.loader.registry import load_model
from kvstack.model.loader.safetensors import config_from_hf
from kvstack.testing.families import tiny_family_config
from kvstack.testing.tiny_models import random_llama_weights, write_gguf, write_hf_folder


def tiny(arch: str, **overrides: Any) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = tiny_family_config(arch, **overrides)
    return cfg, random_llama_weights(cfg, seed=0)


def folder_with(tmp: Path, arch: str, **changes: Any) -> Path:
    """A tiny HF folder of ``arch`` whose ``config.json`` gets ``changes`` (None deletes)."""
    folder = write_hf_folder(tmp / f"{arch}-hf", *tiny(arch))
    data = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    return str(info.value)


def test_registry_lists_every_family() -> None:
    assert ARCHITECTURES.names() == ("llama", "qwen2", "qwen3", "mistral", "gemma3")


def test_unknown_architecture(tmp_path: Path) -> None:
    folder = folder_with(
        tmp_path, "qwen2", architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe"
    )
    msg = load_error(folder)
    assert "unsupported architecture ['Qwen2MoeForCausalLM']" in msg
    assert "Qwen3ForCausalLM" in msg  # the message lists what kvstack serves
    path = write_gguf(tmp_path / "moe.gguf", *tiny("qwen2"), architecture="qwen2moe")
    assert "unsupported architecture 'qwen2moe'" in load_error(path)


@pytest.mark.parametrize(
    ("arch", "key"),
    [("qwen3", "head_dim"), ("qwen2", "hidden_size"), ("mistral", "num_hidden_layers")],
)
def test_config_field_the_family_needs(tmp_path: Path, arch: str, key: str) -> None:
    """Qwen3 must say its head_dim (transformers' default is 128, not hidden / heads)."""
    msg = load_error(folder_with(tmp_path, arch, **{key: None}))
    assert f"config.json lacks {key!r} (needed by {arch} models)" in msg
    msg = load_error(folder_with(tmp_path / "bad", arch, **{key: "many"}))
    assert f"{key}='many' is not an integer" in msg


def test_gguf_metadata_and_tensors_the_family_needs(tmp_path: Path) -> None:
    cfg, w = tiny("qwen3")
    del w["model.layers.1.self_attn.k_norm.weight"]
    msg = load_error(write_gguf(tmp_path / "q3.gguf", cfg, w))
    assert "missing tensors model.layers.1.self_attn.k_norm.weight" in msg
    cfg, w = tiny("qwen2")
    del w["model.layers.0.self_attn.v_proj.bias"]
    msg = load_error(write_hf_folder(tmp_path / "q2", cfg, w))
    assert "missing tensors model.layers.0.self_attn.v_proj.bias" in msg
    # A llama checkpoint carrying a bias is not read as if it had none.
    _, qwen = tiny("qwen2")
    cfg = tiny_family_config("llama", tie_word_embeddings=False)
    llama_w = {**random_llama_weights(cfg), "model.layers.0.self_attn.q_proj.bias": qwen[
        "model.layers.0.self_attn.q_proj.bias"
    ]}  # fmt: skip
    msg = load_error(write_gguf(tmp_path / "llama.gguf", cfg, llama_w))
    assert "unexpected tensor 'blk.0.attn_q.bias' (not a llama weight)" in msg


def bare_gguf(path: Path, **metadata: int | str) -> Path:
    """A qwen3 GGUF holding only ``metadata`` (``qwen3.`` keys) and an embedding."""
    writer = gguf.GGUFWriter(str(path), arch="qwen3")
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(f"qwen3.{key}", value)
        else:
            writer.add_uint32(f"qwen3.{key}", value)
    writer.add_tensor("token_embd.weight", torch.zeros(320, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_or_malformed_gguf_metadata(tmp_path: Path) -> None:
    path = bare_gguf(tmp_path / "bare.gguf", block_count=2)
    assert "missing metadata key qwen3.embedding_length" in load_error(path)
    path = bare_gguf(tmp_path / "str.gguf", embedding_length="wide", block_count=2)
    assert "invalid model metadata: invalid literal for int() with base 10: 'wide'" in load_error(
        path
    )


def test_sliding_windows_load_per_layer_and_bad_ones_are_refused(tmp_path: Path) -> None:
    """Windows shorter than the context load (``model/arch/window.py``), on the layers
    transformers' configs slide: Mistral every layer; Qwen2/Qwen3 those of ``layer_types``
    or from ``max_window_layers`` on (transformers' default 28: none of 2 layers)."""

    def windows(folder: Path) -> list[int | None]:
        cfg = load_model(str(folder)).config
        return [cfg.layer_window(i) for i in range(cfg.num_layers)]

    assert windows(folder_with(tmp_path / "m", "mistral", sliding_window=256)) == [256, 256]
    q = folder_with(
        tmp_path / "q", "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1
    )
    assert windows(q) == [None, 64]
    q = folder_with(
        tmp_path / "q0", "qwen2", use_sliding_window=True, sliding_window=64,
        max_window_layers=None,
    )  # fmt: skip
    assert windows(q) == [None, None]
    types = ["full_attention", "sliding_attention"]
    folder = folder_with(
        tmp_path / "q3", "qwen3", use_sliding_window=True, sliding_window=64, layer_types=types
    )
    assert windows(folder) == [None, 64]
    bad_types = folder_with(
        tmp_path / "q4", "qwen3", use_sliding_window=True, sliding_window=64, layer_types="x"
    )
    assert "invalid layer_types 'x'" in load_error(bad_types)
    for bad in (0, -5, "wide", True):
        msg = load_error(folder_with(tmp_path / f"b{bad}", "mistral", sliding_window=bad))
        assert f"invalid sliding_window {bad!r}" in msg


@pytest.mark.parametrize("value", [100, 0])
def test_gguf_sliding_window_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: int
) -> None:
    """A GGUF's ``{arch}.attention.sliding_window`` is checked as config.json's is and
    slides every layer."""

    class Writer(gguf.GGUFWriter):
        def write_header_to_file(self, *args: Any, **kwargs: Any) -> None:
            self.add_uint32("qwen2.attention.sliding_window", value)
            super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", Writer)
    path = write_gguf(tmp_path / "w.gguf", *tiny("qwen2"))
    if value:
        assert load_model(str(path)).config.layer_window(1) == 100
    else:
        assert "invalid qwen2.attention.sliding_window 0" in load_error(path)


def test_windows_that_never_bind_load_as_full_attention(tmp_path: Path) -> None:
    cfg = load_model(str(folder_with(tmp_path / "m", "mistral", sliding_window=4096))).config
    assert cfg.sliding_window == 4096 and cfg.architecture == "mistral"
    cfg = load_model(str(folder_with(tmp_path / "n", "mistral", sliding_window=None))).config
    assert cfg.sliding_window is None
    # Qwen2.5 releases: a window is declared but use_sliding_window is false.
    folder = folder_with(tmp_path / "q", "qwen2", use_sliding_window=False, sliding_window=64)
    assert load_model(str(folder)).config.sliding_window is None
    # use_sliding_window with no sliding layer (max_window_layers = all layers).
    folder = folder_with(
        tmp_path / "q2", "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2
    )
    assert load_model(str(folder)).config.sliding_window is None


def test_qwen3_biases_are_refused(tmp_path: Path) -> None:
    msg = load_error(folder_with(tmp_path, "qwen3", attention_bias=True))
    assert "config.json sets attention_bias=True" in msg


# The keys of released config.json files (abridged: the keys kvstack reads).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "max_window_layers": 21, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
    "vocab_size": 151936,
}  # fmt: skip
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "vocab_size": 32000,
}  # fmt: skip


def test_released_configs() -> None:
    where = Path("cfg")
    q25 = config_from_hf(QWEN25_05B, where)
    assert (q25.architecture, q25.qkv_bias, q25.qk_norm, q25.head_dim) == ("qwen2", True, False, 64)
    assert q25.sliding_window is None and q25.kv_bytes_per_token(2) == 24 * 2 * 2 * 64 * 2
    q3 = config_from_hf(QWEN3_06B, where)
    assert (q3.architecture, q3.qkv_bias, q3.qk_norm, q3.head_dim) == ("qwen3", False, True, 128)
    assert q3.num_heads * q3.head_dim == 2048 != q3.hidden_size
    v01 = config_from_hf(MISTRAL_7B_V01, where)  # 4,096 of 32,768: every layer slides
    assert [v01.layer_window(i) for i in (0, 31)] == [4096, 4096]
    v03 = config_from_hf({**MISTRAL_7B_V01, "sliding_window": None}, where)
    assert (v03.architecture, v03.head_dim, v03.sliding_window) == ("mistral", 128, None)


@pytest.mark.parametrize("released", [QWEN25_05B, QWEN3_06B, MISTRAL_7B_V01])
def test_any_bad_value_is_a_load_error(released: dict[str, Any]) -> None:
    """Every key of a released config set to a wrong value or dropped: a ModelConfig or one
    ModelLoadError, never another exception (Python's json reads Infinity and NaN)."""
    extra = ("rope_scaling", "rope_parameters", "layer_types", "head_dim", "max_window_layers")
    values: tuple[object, ...] = (None, "x", -1, 0, 2.5, float("inf"), float("nan"), [], {}, True)
    for base in (released, {**released, "use_sliding_window": True}):
        for key in (*base, *extra):
            for bad in values:
                with contextlib.suppress(ModelLoadError):
                    config_from_hf({**base, key: bad}, Path("cfg"))
