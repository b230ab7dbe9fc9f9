"""``benchmarks/latency.py``'s inputs: variants parse into engine keywords (JSON values, a
JSON object with commas), and both fixed prompts are exactly 512 tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import latency


def test_variants_are_names_plus_engine_keywords() -> None:
    assert latency.parse_variant("bf16:") == ("bf16", {})
    assert latency.parse_variant("gguf:quantization=gguf") == ("gguf", {"quantization": "gguf"})
    spec = 'spec:quantization=gguf,speculative_config={"method": "ngram", "k": 4},seed=3'
    assert latency.parse_variant(spec) == (
        "spec",
        {"quantization": "gguf", "speculative_config": {"method": "ngram", "k": 4}, "seed": 3},
    )
    with pytest.raises(SystemExit):
        latency.parse_variant(":quantization=gguf")


def test_fixed_prompts_are_512_tokens() -> None:
    from kvstack.model.registry import load_tokenizer

    prompts = latency.build_prompts()
    assert set(prompts) == {"repetitive", "open"}
    assert all(len(ids) == latency.PROMPT_TOKENS for ids in prompts.values())
    text = load_tokenizer("default").decode(prompts["repetitive"])
    assert text.endswith("Repeat the code above exactly:\n") and "BLAKE2b" in text
    assert latency.build_prompts() == prompts  # seeded: the same prompts every run
