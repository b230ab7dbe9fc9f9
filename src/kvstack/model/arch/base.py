"""``Architecture``: one model family, as a checkpoint names it and as the forward runs it.

Every family kvstack serves is the Llama decoder (RMSNorm, RoPE, grouped-query attention,
SwiGLU; ``model/arch/decoder.py``) plus a few typed features of ``ModelConfig`` (``Features``).
A family is a small module of ``model/arch/`` holding one ``Architecture`` registered in
``ARCHITECTURES`` (``model/arch/__init__.py``); it says

- which checkpoints are its own: Hugging Face ``config.json`` ``architectures`` classes and
  ``model_type`` values, GGUF ``general.architecture`` values;
- which features a checkpoint turns on (``hf_features``, ``gguf_features``), refusing with
  a ``ModelLoadError`` naming the field anything the forward cannot run as the reference
  does (a bias on o_proj, attention logit softcapping...);
- whether llama.cpp's converter permuted the q/k rows of its GGUFs (``gguf_permuted_qk``:
  its ``LLAMA`` arch interleaves each head's RoPE pairs; Qwen2/Qwen3 are written as they
  are, since llama.cpp runs them with NeoX-style rotate-half RoPE).

The loaders (``model/loader/safetensors.py``, ``model/loader/gguf.py``) parse what every
family shares (sizes, RoPE, epsilon) and ask the family for the rest; weight names and shapes follow
from the features (``model/loader/gguf.py`` ``expected_shapes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kvstack.core.errors import ModelLoadError


@dataclass(frozen=True)
class Features:
    """What a family adds to the Llama forward (the same fields of ``ModelConfig``)."""

    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] | None = None  # which layers slide; None = all
    rope_theta: float | None = None  # overrides the shared parse (Gemma 3's global base)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale ** -2 (Gemma 3)


class Architecture:
    """One model family (the protocol of ``ARCHITECTURES``); the defaults are Llama's."""

    name: str = ""
    hf_classes: tuple[str, ...] = ()  # config.json "architectures"
    model_types: tuple[str, ...] = ()  # config.json "model_type"
    gguf_names: tuple[str, ...] = ()  # GGUF general.architecture
    gguf_permuted_qk: bool = False  # llama.cpp interleaved the q/k rows (its LLAMA arch)
    needs_head_dim: bool = False  # config.json must give head_dim (no hidden/heads default)
    hidden_act_key: str = "hidden_act"  # config.json key of the MLP activation ...
    hidden_act: str = "silu"  # ... and the one value the forward runs
    # GGUF: llama.cpp names that differ from ``model/loader/gguf.py`` LAYER_NAMES, and what its
    # converter added to every ``*norm.weight`` (Gemma: 1), subtracted back on load.
    gguf_layer_names: ClassVar[Mapping[str, str]] = {}
    gguf_norm_offset: float = 0.0
    extra_layer_norms: tuple[str, ...] = ()  # per-layer norms beyond Llama's two (Gemma 3)
    summary: str = ""  # one line for ``--help`` and errors

    def hf_features(self, cfg: Mapping[str, Any], context: int, where: Path) -> Features:
        """The features of a ``config.json`` whose context is ``context`` tokens."""
        return Features()

    def gguf_features(
        self, md: Mapping[str, Any], prefix: str, context: int, where: Path
    ) -> Features:
        """The features of a GGUF's metadata (keys ``{prefix}.*``)."""
        return Features(sliding_window=gguf_window(md, prefix, context, where))

    def describe(self) -> str:
        return f"{self.name} ({', '.join(self.hf_classes)})"


def reject_keys(cfg: Mapping[str, Any], keys: tuple[str, ...], why: str, where: Path) -> None:
    """``ModelLoadError`` naming the first of ``keys`` that ``cfg`` sets truthy."""
    for key in keys:
        if cfg.get(key):
            raise ModelLoadError(f"{where}: config.json sets {key}={cfg[key]!r}: {why}")


def check_window(window: object, context: int, where: Path, field: str) -> int | None:
    """A sliding window: None (full attention) or a positive token count (one shorter than
    ``context`` hides older keys, ``model/arch/window.py``); else ``ModelLoadError`` naming
    ``field``."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ModelLoadError(f"{where}: invalid {field} {window!r} (a positive token count)")
    return window


def gguf_window(md: Mapping[str, Any], prefix: str, context: int, where: Path) -> int | None:
    """``{prefix}.attention.sliding_window`` of a GGUF, checked (absent: None)."""
    key = f"{prefix}.attention.sliding_window"
    return check_window(md.get(key), context, where, key)
