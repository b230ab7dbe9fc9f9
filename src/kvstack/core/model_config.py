"""``ModelConfig`` and ``RopeScaling``: the architecture a checkpoint describes.

Layer 0: read from a GGUF file or a Hugging Face ``config.json`` (``kvstack.model``) and
sized against by the KV storage (``kvstack.kv``), so it imports nothing but the errors.
Both are frozen: a loaded model never changes shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.core.errors import ConfigError


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
    ``mistral``); the forward (``model/arch/decoder.py``) reads only the typed features below:

    - ``qkv_bias``: the q, k and v projections carry a bias, o_proj does not (Qwen2);
    - ``qk_norm``: a per-head RMSNorm of ``head_dim`` weights on q and on k before RoPE
      (Qwen3);
    - ``head_dim``: explicit, may differ from ``hidden_size // num_heads`` (Qwen3);
    - ``sliding_window``: the attention window W of the sliding layers (None = none): a
      query at position p attends keys (p - W, p], W of them, as transformers'
      ``masking_utils.sliding_window_overlay`` (``model/arch/window.py``);
    - ``window_layers``: which layers slide (True) and which attend to every key; None =
      every layer slides when ``sliding_window`` is set (Mistral). ``layer_window(i)``
      is what the forward reads; the hybrid KV manager (``kv/groups.py``) groups layers
      by it and frees the KV older than a window.

    - ``rope_local_theta``: the RoPE base of the sliding layers (None: ``rope_theta``);
      ``query_pre_attn_scalar``: the attention scale is its ``-0.5`` power (None:
      ``head_dim``'s) (both Gemma 3, whose layer runs in ``model/arch/gemma3_decoder.py``).

    Invariants: ``num_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention);
    a ``sliding_window`` is positive; ``window_layers`` has one entry per layer.
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
    window_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        window = self.sliding_window
        if window is not None and window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {window}")
        layers = self.window_layers
        if layers is not None and len(layers) != self.num_layers:
            raise ConfigError(
                f"window_layers names {len(layers)} layers, the model has {self.num_layers}"
            )

    def layer_window(self, layer: int) -> int | None:
        """The window of ``layer``: None when it attends to every key (a full-attention
        layer, or a window that covers the whole context)."""
        w = self.sliding_window
        if w is None or w >= self.max_position_embeddings:
            return None
        if self.window_layers is not None and not self.window_layers[layer]:
            return None
        return w

    def layer_rope_theta(self, layer: int) -> float:
        """The RoPE base of ``layer``: ``rope_local_theta`` on a sliding layer, if set."""
        slides = self.window_layers is None or self.window_layers[layer]
        if self.sliding_window is not None and slides and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def has_window(self) -> bool:
        """True when some layer attends to fewer keys than the context holds."""
        return any(self.layer_window(i) is not None for i in range(self.num_layers))

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes
