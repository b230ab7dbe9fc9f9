"""What ``kvstack eval`` compares and with which settings: variants and ``EvalConfig``.

A variant is a label plus ``LLM`` keyword arguments (a ``--kv-cache-dtype`` codec, or a
``--kv-press`` at one ratio), so other KV compression methods can be compared the same
way; the baseline is ``auto`` (the KV cache in the model's ``--dtype``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvstack.errors import ConfigError

DEFAULT_CODECS = ("fp8", "int8", "int4", "kivi2", "rotated4")
BASELINE = "auto"
CORPUS_KIND = "TextMaker synthetic prose, seeded"
# option -> (full default, --quick default)
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "contexts": ([1024, 2048, 4096], [1024, 4096]),
    "num_texts": (2, 1),
    "greedy_tokens": (64, 32),
    "needle_lengths": ([1024, 2048, 4096], [2048]),
    "needle_depths": ([0.1, 0.5, 0.9], [0.1, 0.5, 0.9]),
    "needle_trials": (3, 2),
    "batch": (8, 4),
}


@dataclass(frozen=True)
class Variant:
    """What is compared against the baseline: a label and extra ``LLM`` keyword arguments."""

    label: str
    llm_kwargs: dict[str, Any]


def codec_variant(name: str) -> Variant:
    return Variant(name, {"kv_cache_dtype": name})


def press_variant(name: str, ratio: float) -> Variant:
    """A press removing ``ratio`` of each prompt's KV (applied after the first half of a
    scored text, after a greedy prompt, and before a needle prompt's question)."""
    return Variant(f"{name}@{ratio:g}", {"kv_press": name, "kv_press_ratio": ratio})


@dataclass
class EvalConfig:
    """Everything ``run_eval`` needs; ``validate`` raises ``ConfigError`` on bad values."""

    variants: list[Variant] = field(
        default_factory=lambda: list(map(codec_variant, DEFAULT_CODECS))
    )
    model: str = "default"
    dtype: str = "bfloat16"
    contexts: list[int] = field(default_factory=lambda: list(DEFAULTS["contexts"][0]))
    num_texts: int = DEFAULTS["num_texts"][0]
    greedy_tokens: int = DEFAULTS["greedy_tokens"][0]
    needle_lengths: list[int] = field(default_factory=lambda: list(DEFAULTS["needle_lengths"][0]))
    needle_depths: list[float] = field(default_factory=lambda: list(DEFAULTS["needle_depths"][0]))
    needle_trials: int = DEFAULTS["needle_trials"][0]
    needle_tokens: int = 12
    memory: int = 1 << 30
    batch: int = DEFAULTS["batch"][0]
    seed: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 512
    quick: bool = False
    progress: bool = True
    corpus: str = "prose"  # "prose" (TextMaker, ppl ~50) or "generated" (the model's own)

    def validate(self, max_model_len: int | None = None) -> None:
        from kvstack.kv.codecs import codec_class

        if not self.variants:
            raise ConfigError("nothing to evaluate: the --kv-cache-dtype list is empty")
        from kvstack.kv.press import check_press

        for v in self.variants:
            codec_class(str(v.llm_kwargs.get("kv_cache_dtype", BASELINE)))
            try:
                check_press(v.llm_kwargs.get("kv_press"), v.llm_kwargs.get("kv_press_ratio", 0.0))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.corpus not in ("prose", "generated"):
            raise ConfigError(f"--corpus must be prose or generated, got {self.corpus!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"--dtype must be bfloat16 or float32, got {self.dtype!r}")
        for name, n in (
            ("--num-texts", self.num_texts),
            ("--greedy-tokens", self.greedy_tokens),
            ("--needle-trials", self.needle_trials),
            ("--needle-tokens", self.needle_tokens),
            ("--batch", self.batch),
            ("--memory", self.memory),
        ):
            if n <= 0:
                raise ConfigError(f"{name} must be positive, got {n}")
        for name, lengths, extra in (
            ("--contexts", self.contexts, self.greedy_tokens),
            ("--needle-lengths", self.needle_lengths, self.needle_tokens),
        ):
            if not lengths:
                raise ConfigError(f"{name} is empty")
            if min(lengths) < 64:
                raise ConfigError(f"{name} must be at least 64 tokens, got {min(lengths)}")
            if max_model_len is not None and max(lengths) + extra > max_model_len:
                raise ConfigError(
                    f"{name} {max(lengths)} plus {extra} generated tokens is longer than "
                    f"the model's context ({max_model_len} tokens)"
                )
        if not self.needle_depths or any(not 0.0 <= d <= 1.0 for d in self.needle_depths):
            raise ConfigError(f"--needle-depths must be in [0, 1], got {self.needle_depths}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["variants"] = [asdict(v) for v in self.variants]
        return d
