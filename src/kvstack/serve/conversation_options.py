"""Options of multi-turn serving: ``--reasoning-parser``, how earlier turns' reasoning is
rendered, and the bounds of the Responses API's server-side conversation state.

A part of ``ServerOptions`` (``options.py`` flattens its fields into ``kvstack serve``'s
flags). Every bound is finite by default: stored responses are capped in count, age and
bytes, and the KV pinned for the next turn of a stored conversation is capped at a share
of the pool and released after ``responses_pin_ttl`` seconds (``serve/responses/store.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.core.errors import ConfigError
from kvstack.core.options import check_choices, option

GROUP = "conversations"
REASONING_HISTORY = ("strip", "keep")


@dataclass(frozen=True)
class ConversationOptions:
    """Reasoning and Responses-store options; every bound > 0, the pin share in [0, 1]
    (0: no pins)."""

    reasoning_parser: str | None = option(
        None,
        "split a reasoning model's <think>…</think> into the message's `reasoning` field "
        "(chat completions, streamed or not, and the Responses API's reasoning items), as "
        "vLLM's flag; the model's chat template must write the parser's markers",
        group=GROUP, choices=lambda: _reasoning_parsers(),
    )  # fmt: skip
    reasoning_history: str = option(
        "strip",
        "a Responses turn continuing a stored one (previous_response_id): strip renders "
        "the history through the chat template, which drops earlier turns' reasoning as "
        "Qwen3's does, so the previous answer's KV is recomputed; keep continues from the "
        "previous turn's exact tokens (reasoning included), so all of it is a prefix-cache "
        "hit (docs/responses.md has the measured difference)",
        group=GROUP, choices=lambda: REASONING_HISTORY,
    )  # fmt: skip
    responses_max_stored: int = option(
        1000, "stored responses kept at most (the oldest go first)", group=GROUP
    )
    responses_ttl: float = option(
        3600.0, "seconds a stored response is kept (then its id answers 404)", group=GROUP
    )
    responses_max_bytes: int = option(
        64 * 1024 * 1024,
        "bytes all stored responses may hold (JSON plus token ids; the oldest go first)",
        group=GROUP,
    )
    responses_pin_fraction: float = option(
        0.25,
        "share of the KV pool that stored conversations' next-turn prefixes may keep "
        "pinned; these pins are the first KV released when the pool runs short",
        group=GROUP,
    )
    responses_pin_ttl: float = option(
        300.0, "seconds a stored conversation's KV stays pinned awaiting its next turn",
        group=GROUP,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for flag, value in (
            ("--responses-max-stored", self.responses_max_stored),
            ("--responses-ttl", self.responses_ttl),
            ("--responses-max-bytes", self.responses_max_bytes),
            ("--responses-pin-ttl", self.responses_pin_ttl),
        ):
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if not 0 <= self.responses_pin_fraction <= 1:
            raise ConfigError(
                f"--responses-pin-fraction must be in [0, 1], got {self.responses_pin_fraction}"
            )
        check_choices(self)


def _reasoning_parsers() -> tuple[str, ...]:
    from kvstack.serve.chat.reasoning_parsers import REASONING_PARSERS

    return REASONING_PARSERS.names()
