"""``ModelConfig`` and ``RopeScaling``: the architecture a checkpoint describes.

Layer 0: read from a GGUF file or a Hugging Face ``config.json`` (``kvstack.model``) and
sized against by the KV storage (``kvstack.kv``), so it imports nothing but the errors.
Both are frozen: a loaded model never changes shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.errors import ConfigError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type == "llama3"``).

    Low frequencies are divided by ``factor``, high frequencies kept, and the band in
    between interpolated smoothly (Meta, "The Llama 3 Herd of Models", 2024).
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-style decoder and the features its family adds.

    ``architecture`` names its entry in ``model/arch/`` (``llama``, ``qwen2``, ``qwen3``,
    ``mistral``); the forward (``model/llama.py``) reads only the typed features below:

    - ``qkv_bias``: the q, k and v projections carry a bias, o_proj does not (Qwen2);
    - ``qk_norm``: a per-head RMSNorm of ``head_dim`` weights on q and on k before RoPE
      (Qwen3);
    - ``head_dim``: explicit, may differ from ``hidden_size // num_heads`` (Qwen3);
    - ``sliding_window``: the checkpoint's attention window, kept only when it never binds
      (at least ``max_position_embeddings``: every key stays visible); None = none.

    Invariants: ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention);
    a ``sliding_window`` is never shorter than the context (kvstack attends to every key).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    architecture: str = "llama"
    name: str = "model"
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        window = self.sliding_window
        if window is not None and window < self.max_position_embeddings:
            raise ConfigError(
                f"sliding_window {window} is shorter than the context "
                f"({self.max_position_embeddings}); kvstack has no windowed attention"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes
