"""``SchedulerConfig``: the continuous-batching limits the scheduler enforces.

Declared here, beside the scheduler that reads it, and gathered into ``EngineConfig``
(``config/engine.py``) with the other option groups; the flags are vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.core.errors import ConfigError
from kvstack.core.options import Switch, option

ENGINE = "engine"  # the --help group of the engine's options


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits (vLLM's ``--max-num-seqs`` etc.); all positive.

    ``max_model_len`` None means the model's context length.
    """

    max_num_seqs: int = option(32, "max requests running in one step", group=ENGINE)
    max_num_batched_tokens: int = option(
        2048, "token budget of one step (prefill chunks + decodes)", group=ENGINE
    )
    max_model_len: int | None = option(
        None,
        "max prompt + output tokens per request (default: the model's context)",
        group=ENGINE,
    )
    enable_chunked_prefill: bool = option(
        True,
        "split a prompt longer than the step's token budget over several steps (False: "
        "admit a prompt only when it fits the step's token budget whole)",
        group=ENGINE, flag="--no-chunked-prefill", aliases=("--no-enable-chunked-prefill",),
        flag_help="admit a prompt only when it fits the step's token budget whole",
        switches=(Switch("--enable-chunked-prefill", True, "vLLM's: chunked prefill on "
                         "(the default)"),),
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
