"""``SpeculativeConfig``: vLLM's ``--speculative-config`` JSON, parsed and checked.

vLLM's spelling (``vllm/config/speculative.py``)::

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
                           "prompt_lookup_max": 5, "prompt_lookup_min": 2}'

and ``LLM(speculative_config={...})``. vLLM's defaults for ``ngram``: with neither
bound given both are 5; with one given the other equals it; ``num_speculative_tokens``
is required (vLLM: "num_speculative_tokens was provided but without speculative model"
when missing a method, and a positive int otherwise). ``"[ngram]"`` is vLLM's old
spelling of ``"ngram"``.

A draft model, vLLM's spelling (``method`` is ``"draft_model"`` when a ``model`` is given
without one; ``quantization`` is how the draft's weights are loaded)::

    --speculative-config '{"model": "default", "quantization": "gguf",
                           "num_speculative_tokens": 4}'

(``spec/draft_model.py``: here the draft writes its rows into the target's KV cache, so
it must have the target's KV shape: the same model with other weights or quantization.)
Other vLLM methods (EAGLE, MTP, suffix) are refused by name: only proposers in
``spec.PROPOSERS`` exist here.

Plain Python (layer 1): the engine-wide limits (the step's token budget, the context,
codecs and presses that cannot roll back) are checked where they are known
(``spec/speculator.py``: ``check_engine``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvstack.core.errors import ConfigError

DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds ("arbitrarily chosen")
DRAFT_MODEL = "draft_model"
_ALIASES = {"[ngram]": "ngram"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculation method and its parameters (vLLM's field names).

    Invariants (``__post_init__``): ``num_speculative_tokens >= 1``;
    ``1 <= prompt_lookup_min <= prompt_lookup_max``; ``method`` is a registered proposer;
    ``model`` is set exactly when ``method`` is ``draft_model`` (``quantization`` only then).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None  # draft_model: the draft (name or path)
    quantization: str | None = None  # draft_model: its --quantization (default none)

    def __post_init__(self) -> None:
        from kvstack.spec import PROPOSERS  # the registry imports the proposers

        PROPOSERS.get(self.method)  # ConfigError listing the methods
        if (self.method == DRAFT_MODEL) != (self.model is not None):
            raise ConfigError(
                'speculative_config: "model" names the draft of method "draft_model" '
                f"(got method {self.method!r}, model {self.model!r})"
            )
        if self.quantization is not None and self.method != DRAFT_MODEL:
            raise ConfigError('speculative_config: "quantization" is the draft model\'s')
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ConfigError(
                f"speculative_config: num_speculative_tokens must be a positive integer, got {k!r}"
            )
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A ``SpeculativeConfig`` from JSON text, a dict, or one already built (idempotent,
    as an option's ``convert`` must be). ``ConfigError`` names what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"speculative_config must be a JSON object such as "
            f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r}'
        )
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"speculative_config: unsupported field(s) {', '.join(unknown)} "
            f"(kvstack knows {', '.join(sorted(known))})"
        )
    if "method" not in value and "model" in value:  # vLLM: a model without a method
        value = {**value, "method": DRAFT_MODEL}
    if "method" not in value:
        raise ConfigError('speculative_config needs a "method" ("ngram") or a draft "model"')
    method: Any = _ALIASES.get(value["method"], value["method"])
    if "num_speculative_tokens" not in value:
        raise ConfigError("speculative_config needs num_speculative_tokens")
    model, quant = value.get("model"), value.get("quantization")
    for name, v in (("model", model), ("quantization", quant)):
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"speculative_config: {name} must be a string, got {v!r}")
    if method == DRAFT_MODEL:
        lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(value))
        if lookup:
            raise ConfigError(f"speculative_config: {', '.join(lookup)} is for method ngram")
        k = value["num_speculative_tokens"]
        return SpeculativeConfig(method, k, model=model, quantization=quant)
    lo: Any = value.get("prompt_lookup_min")
    hi: Any = value.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    return SpeculativeConfig(
        method, value["num_speculative_tokens"], hi, lo, model=model, quantization=quant
    )
