"""Default sampling parameters from a model's generation config (vLLM's ``--generation-config``).

``auto`` reads the model's own: ``generation_config.json`` of a Hugging Face folder (a
GGUF file carries none); ``vllm`` uses none (vLLM's and OpenAI's defaults); any other
value is a folder holding a ``generation_config.json``. Of that file, the fields vLLM
takes are kept, where set to something other than transformers' defaults (vLLM reads
``GenerationConfig.to_diff_dict()``): ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``). They apply to a
request that does not set the field (``LLMEngine.generation_defaults``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.request import SamplingParams

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
_FIELDS = {  # generation_config.json key -> (SamplingParams field, type)
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}
# transformers' GenerationConfig defaults: a field equal to its default is not a choice.
_HF_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0,
}  # fmt: skip


def load_generation_defaults(choice: str, model_path: Path) -> dict[str, Any]:
    """The sampling defaults ``choice`` names for the model at ``model_path`` (resolved)."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        path = model_path / FILE
        if model_path.is_file() or not path.is_file():
            return {}
    else:
        path = Path(choice).expanduser() / FILE
        if not path.is_file():
            raise ConfigError(
                f"--generation-config {choice!r}: no {FILE} there (give auto, vllm or a folder)"
            )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    defaults = sampling_defaults(data, str(path))
    if defaults:
        logger.info(
            "default sampling parameters from %s: %s (ignore them with --generation-config "
            "vllm)", path, defaults,
        )  # fmt: skip
    return defaults


def sampling_defaults(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``SamplingParams`` fields a generation config sets (see the module docstring)."""
    out: dict[str, Any] = {}
    for key, (name, kind) in _FIELDS.items():
        value = config.get(key)
        if value is None or (key in _HF_DEFAULTS and value == _HF_DEFAULTS[key]):
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
        if kind is int and value != int(value):
            raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        out[name] = kind(value)
    try:
        SamplingParams(**out).validate()
    except InvalidRequestError as e:
        raise ConfigError(f"{source}: {e}") from None
    return out
