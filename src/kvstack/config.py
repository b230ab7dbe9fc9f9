"""Frozen configuration dataclasses shared by every part of the engine.

``ModelConfig`` describes the architecture (read from a GGUF file or a Hugging Face
``config.json``); ``CacheConfig``, ``SchedulerConfig`` and ``EngineConfig`` hold the
user's choices. All are immutable: a running engine never changes its configuration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    """Architecture of a Llama-family decoder (the only family kvstack serves today)."""

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


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing (vLLM PagedAttention).

    Exactly one of ``num_blocks`` / ``kv_cache_memory`` decides the pool size; when both
    are None the engine uses ``DEFAULT_KV_CACHE_MEMORY``.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    # Era 3 prefix reuse: "hash" (vLLM v1 hash chain), "radix" (SGLang radix tree), "none".
    prefix_cache: str = "hash"
    eviction_policy: str = "lru"  # lru | lfu | adaptive (kv/policies.py)
    max_pinned_fraction: float = 0.5  # pins may hold at most this share of the blocks
    # "paged" (era 2+), or the era-1 baselines "contiguous" (max_model_len slab per
    # request) and "contiguous-request" (prompt + max_tokens slab); kv/contiguous.py.
    kv_layout: str = "paged"
    # Era 4 offload tiers, ``--kv-offload`` syntax (``kv/tiers/spec.py``), e.g.
    # "host:2GiB,disk:/var/cache/kvstack:20GiB,redis://127.0.0.1:6379"; None = none.
    kv_offload: str | None = None
    # Era 5 KV codec (``kv/codecs.py``): auto | bf16 | fp8 | int8 | int4 | kivi2 | rotated4.
    kv_cache_dtype: str = "auto"
    # Era 5 press applied to every request after its prompt (``kv/press/``), and the
    # fraction of its KV removed; requests may override both.
    kv_press: str | None = None
    kv_press_ratio: float = 0.0
    # Press again every N generated tokens, back to the budget the first press left
    # (None: only after the prompt); requests may override it.
    kv_press_every: int | None = None

    def __post_init__(self) -> None:
        from kvstack.kv.policies import POLICIES

        bs = self.block_size
        if bs <= 0 or bs & (bs - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {bs}")
        choices = {
            "prefix_cache": (self.prefix_cache, ("hash", "radix", "none")),
            "eviction_policy": (self.eviction_policy, tuple(POLICIES)),
            "kv_layout": (self.kv_layout, ("paged", "contiguous", "contiguous-request")),
        }
        for name, (value, valid) in choices.items():
            if value not in valid:
                raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(valid)}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ConfigError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        from kvstack.kv.codecs import codec_class

        codec_class(self.kv_cache_dtype)  # one clear error for an unknown codec
        from kvstack.kv.press import check_press, check_repress

        try:
            check_press(self.kv_press, self.kv_press_ratio)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.kv_press_every is not None:
            if self.kv_press_every < 1:
                raise ConfigError(f"kv_press_every must be at least 1, got {self.kv_press_every}")
            if self.kv_press is None:
                raise ConfigError("--kv-press-every needs a --kv-press")
            try:
                check_repress(self.kv_press)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.kv_press is not None and self.kv_layout != "paged":
            raise ConfigError("--kv-press needs the paged layout (--kv-layout paged)")
        if self.kv_cache_dtype != "auto" and self.kv_layout != "paged":
            raise ConfigError("--kv-cache-dtype needs the paged layout (--kv-layout paged)")
        if self.kv_offload:
            from kvstack.kv.tiers.spec import parse_offload_spec

            parse_offload_spec(self.kv_offload)  # one clear error at startup
            if self.kv_layout != "paged" or self.prefix_cache == "none":
                raise ConfigError(
                    "--kv-offload needs the paged layout and a prefix cache (hash or radix): "
                    "tiers are keyed by the prefix hash chain"
                )


DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits (vLLM's ``--max-num-seqs`` etc.).

    ``max_model_len`` None means the model's context length.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an ``LLMEngine`` is built from."""

    model: str = "default"
    dtype: str = "bfloat16"
    tokenizer: str | None = None
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}


def parse_size(text: str | int) -> int:
    """Parse a memory size such as ``2GiB``, ``512MiB``, ``1.5G`` or ``1048576`` to bytes.

    ``KiB/MiB/GiB`` are powers of 1024, ``K/M/G`` (with or without ``B``) powers of 1000.
    """
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"cannot parse memory size {text!r} (examples: 2GiB, 512MiB, 1000000)")
    number, unit = float(m.group(1)), (m.group(2) or "").upper()
    if "I" in unit:
        scale = 1024 ** "KMGT".index(unit[0]) * 1024
    else:
        scale = _UNITS[unit.rstrip("B") if unit != "B" else "B"]
    value = int(number * scale)
    if value <= 0:
        raise ConfigError(f"memory size must be positive, got {text!r}")
    return value
