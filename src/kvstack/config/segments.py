"""``SegmentConfig``: the engine options of segment reuse (``kv/segments.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.options import check_choices, option
from kvstack.core.segment_marks import check_recompute

KV = "KV cache"


def _segment_caches() -> tuple[str, ...]:
    from kvstack.config.choices import eviction_policies

    return ("auto", *eviction_policies(), "none")


@dataclass(frozen=True)
class SegmentConfig:
    """Whether marked prompt segments (tools, documents, ``kvstack_segment`` parts,
    ``LLM.generate(segments=...)``) reuse standalone KV, and how much is recomputed."""

    segment_cache: str = option(
        "auto",
        "reuse the KV of marked prompt segments (each tool, each document, content parts "
        "with \"kvstack_segment\": true) wherever they sit in a prompt, computed "
        "standalone once (a tool after an example tool, its primer) and placed with "
        "re-rotated keys; the value is the eviction policy "
        "of the entries: 'auto' (default) follows --eviction-policy, or one of its "
        "policies by name (lru, lfu, adaptive); 'none' ignores the marks",
        group=KV, choices=_segment_caches,
    )  # fmt: skip
    segment_recompute_ratio: float = option(
        0.0,
        "repair of a placed segment: the share of its tokens (after the first N) "
        "recomputed with the request's context, those whose layer-1 KV deviates most "
        "(CacheBlend), in [0, 1]; 1 equals a full prefill. Default 0: measured on "
        "SmolLM2-135M, the first 32 tokens alone repair more per computed token (README "
        "'Segment reuse'). Requests may set segment_recompute_ratio",
        group=KV,
    )  # fmt: skip
    segment_recompute_tokens: int = option(
        32,
        "repair: the first N tokens of every placed segment are always recomputed (EPIC); "
        "requests may set segment_recompute_tokens",
        group=KV, metavar="N",
    )  # fmt: skip
    segment_max_fraction: float = option(
        0.5,
        "segments may hold at most this fraction of the KV blocks (default 0.5)",
        group=KV,
    )

    def __post_init__(self) -> None:
        check_choices(self)
        try:
            check_recompute(self.segment_recompute_ratio, self.segment_recompute_tokens)
        except InvalidRequestError as e:
            raise ConfigError(str(e)) from None
        if not 0.0 < self.segment_max_fraction <= 1.0:
            raise ConfigError(
                f"segment_max_fraction must be in (0, 1], got {self.segment_max_fraction}"
            )
