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
    """Architecture of a Llama-family decoder (the only family kvstack serves today).

    Invariant: ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention).
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes
