"""Qwen2.5-Coder-0.5B-Instruct (``--model qwen2.5-coder-0.5b``, Q4_K_M, joined from its part
wheels) against transformers reading the same GGUF, float32, ``--quantization none``.

The comparison itself lives in ``kvstack.testing.real_models`` (the 1.5B's runs in
``benchmarks/real_model_check.py``, outside the suite: ~7 GB in float32). One model of each
side is loaded for the module; the heavy checks are slow-marked. The part wheels and
transformers come with the test extra (pyproject.toml): a missing one fails, never skips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from kvstack import LLM
from kvstack.model.loader.registry import load_tokenizer, read_model_config, resolve_model_path
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.serve.api.served_names import default_served_names
from kvstack.testing.real_models import (
    CHATS,
    TEMPLATE_CASES,
    RealModelCheck,
    check_real_model,
    load_kvstack,
    load_reference,
    render,
    run_reference,
)

MODEL = "qwen2.5-coder-0.5b"
NEW_TOKENS = 16
LOGIT_ATOL = 2e-3  # fp32, other GEMMs and attention: observed ~7e-5


@pytest.fixture(scope="module")
def path() -> Path:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def hf_tok(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(MODEL)


def test_the_shortcut_reads_the_qwen_gguf(path: Path, tok: Tokenizer) -> None:
    """Header only: the architecture the issue's table gives, the ChatML tokens, and the
    served id (the file's stem, as for the other shortcuts)."""
    cfg = read_model_config("Qwen2.5-Coder-0.5B-Instruct")
    assert cfg.architecture == "qwen2" and cfg.qkv_bias and not cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (24, 896, 14, 2)
    assert (cfg.head_dim, cfg.vocab_size) == (64, 151936)
    assert tok.eos_token_id == 151645 and 151645 in tok.eos_token_ids
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # no BOS added
    assert default_served_names(MODEL) == ("qwen2.5-coder-0.5b-instruct-q4_k_m",)
    assert path.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@pytest.mark.parametrize("case", range(len(TEMPLATE_CASES)))
def test_chat_template_renders_as_transformers(tok: Tokenizer, hf_tok: Any, case: int) -> None:
    """ChatML with and without tools, a finished tool call and its result included."""
    chat = TEMPLATE_CASES[case]
    assert render(tok, chat, True) == render(hf_tok, chat, False)
    if chat[1] is not None:
        assert "get_weather" in render(tok, chat, True)


@pytest.fixture(scope="module")
def check(path: Path) -> RealModelCheck:
    """Both sides run once for the module, one float32 model in memory at a time."""
    hf, tok = load_reference(path)
    ref = run_reference(hf, tok, NEW_TOKENS)
    del hf
    llm: LLM = load_kvstack(MODEL)
    result = check_real_model(MODEL, path, llm, ref, NEW_TOKENS)
    print(result)
    return result


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(check: RealModelCheck) -> None:
    assert check.template_mismatches == []
    assert len(check.prompts) == len(CHATS)
    for i, p in enumerate(check.prompts):
        assert p.ids_equal, f"prompt {i}: tokenized chat template differs"
        assert len(p.kvstack) == NEW_TOKENS
        assert p.tokens_ok, (
            f"prompt {i} diverges at token {p.first_difference} "
            f"({p.reference} vs {p.kvstack}), reference top-2 gap {p.gap_there}"
        )


@pytest.mark.slow
def test_logits_match_transformers(check: RealModelCheck) -> None:
    for i, p in enumerate(check.prompts):
        assert p.max_logit_diff < LOGIT_ATOL, f"prompt {i}: max |diff| {p.max_logit_diff:.1e}"
        assert p.argmax_equal, f"prompt {i}: per-position argmax differs"
    assert check.ok(LOGIT_ATOL)
