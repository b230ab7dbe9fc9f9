"""vLLM's import path ``vllm.sampling_params``: ``SamplingParams`` and
``StructuredOutputsParams`` (``from kvstack.sampling_params import StructuredOutputsParams``
works where a vLLM script imports them from ``vllm.sampling_params``)."""

from __future__ import annotations

from kvstack.core.request import SamplingParams
from kvstack.core.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
