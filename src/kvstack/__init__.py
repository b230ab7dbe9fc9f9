"""kvstack: an LLM inference engine whose centre is the KV cache.

``from kvstack import LLM, SamplingParams, TokensPrompt`` gives vLLM's offline API
(``kvstack.sampling_params`` holds ``SamplingParams`` and ``StructuredOutputsParams`` at
vLLM's import path);
``LLM.from_config(EngineConfig(...))`` builds one from a ready configuration. Heavy
modules (torch) load lazily so ``kvstack --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.core.prompts import TextPrompt, TokensPrompt
from kvstack.core.request import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvstack.config.engine import EngineConfig
    from kvstack.engine.llm import LLM
    from kvstack.engine.llm_engine import LLMEngine

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvstack.engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from kvstack.config.engine import EngineConfig

        return EngineConfig
    if name == "LLMEngine":
        from kvstack.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
