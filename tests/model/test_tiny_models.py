"""A tiny random model written by the test as GGUF and as a Hugging Face folder runs
through the whole engine with identical outputs from both loaders."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstack import LLM, SamplingParams
from kvstack.model.loader.registry import default_model_path
from kvstack.testing.tiny_models import (
    random_llama_weights,
    tiny_llama_config,
    write_gguf,
    write_hf_folder,
)

PROMPTS = ["Hello world", "The KV cache stores keys and values", "1 2 3 4 5 6 7 8 9"]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("tiny")
    cfg = tiny_llama_config(vocab_size=49152, tie_word_embeddings=False)
    weights = random_llama_weights(cfg, seed=3)
    gguf_path = write_gguf(tmp / "tiny.gguf", cfg, weights, tokenizer_from=default_model_path())
    hf_path = write_hf_folder(tmp / "tiny-hf", cfg, weights, tokenizer_from=default_model_path())
    return gguf_path, hf_path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_and_hf_folder_generate_the_same(tiny_paths: tuple[Path, Path], dtype: str) -> None:
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    results = []
    for path in tiny_paths:
        llm = LLM(str(path), dtype=dtype, num_blocks=32, block_size=8)
        outs = llm.generate(PROMPTS, sp, check_integrity=True)
        assert llm.engine.num_free_blocks == 32
        results.append(outs)
    a, b = results
    for oa, ob in zip(a, b, strict=True):
        assert oa.prompt_token_ids == ob.prompt_token_ids
        assert oa.outputs[0].token_ids == ob.outputs[0].token_ids
        assert oa.outputs[0].text == ob.outputs[0].text
        assert len(oa.outputs[0].token_ids) == 16
