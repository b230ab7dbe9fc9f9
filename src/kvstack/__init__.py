"""kvstack: an LLM inference engine whose centre is the KV cache.

``from kvstack import LLM, SamplingParams`` gives vLLM's offline API. Heavy modules
(torch) load lazily so ``kvstack --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstack.request import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvstack.engine import LLMEngine
    from kvstack.llm import LLM

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvstack.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvstack.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
