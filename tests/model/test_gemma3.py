"""Gemma 3 (text) against transformers' ``Gemma3ForCausalLM``: tiny random models saved by
transformers and written as llama.cpp writes a gemma3 GGUF, fp32, head_dim 256.

Two shapes: ``scaled`` (3 layers: local, local, global; ``query_pre_attn_scalar`` 64, so
the scale is not ``head_dim``'s) and ``llama_cpp`` (6 layers in llama.cpp's fixed pattern,
scalar = head_dim: what its gemma3 GGUFs can say). Logits run whole and in chunks shorter
and longer than the window of 8 (PyTorch ops and C++ kernels) are within ``LOGIT_ATOL`` of
transformers'; greedy tokens match under batching, chunking, preemption and prefix reuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.core.errors import ModelLoadError
from kvstack.core.model_config import ModelConfig
from kvstack.model.arch.gemma3_decoder import Gemma3Model
from kvstack.model.arch.ops import select_ops
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.loader.registry import load_model
from kvstack.testing.families import hf_greedy, paged_logits, write_transformers_folder
from kvstack.testing.gemma3 import (
    random_gemma3_weights,
    tiny_gemma3_config,
    transformers_gemma3,
)
from kvstack.testing.tiny_models import write_gguf

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 2e-3
TIE_GAP = 1e-4
NEW_TOKENS = 12
SHAPES = {
    "scaled": {},
    "llama_cpp": {
        "num_layers": 6,
        "window_layers": (True,) * 5 + (False,),
        "query_pre_attn_scalar": 256.0,
    },
}


@dataclass
class Tiny:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    hf: Any
    paths: list[Path]  # the HF folder, and the GGUF where llama.cpp's layout can say it


@pytest.fixture(scope="module", params=list(SHAPES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    cfg = tiny_gemma3_config(**SHAPES[request.param])
    weights = random_gemma3_weights(cfg, seed=3)
    hf = transformers_gemma3(cfg, weights)
    tmp = tmp_path_factory.mktemp(f"gemma3-{request.param}")
    paths = [write_transformers_folder(tmp / "hf", hf, cfg.vocab_size)]
    if request.param == "llama_cpp":
        paths.append(write_gguf(tmp / "m.gguf", cfg, weights))
    return Tiny(cfg, weights, hf, paths)


def test_both_formats_load_the_config_and_weights(tiny: Tiny) -> None:
    for path in tiny.paths:
        loaded = load_model(str(path))
        cfg = loaded.config
        for field in ("architecture", "head_dim", "sliding_window", "window_layers", "rope_theta"):
            assert getattr(cfg, field) == getattr(tiny.config, field), (path.name, field)
        assert (cfg.rope_local_theta, cfg.query_pre_attn_scalar, cfg.tie_word_embeddings) == (
            10000.0,
            tiny.config.query_pre_attn_scalar,
            True,
        )
        assert loaded.weights.keys() == tiny.weights.keys()
        for name, w in tiny.weights.items():  # the GGUF's norms are 1 + w, given back as w
            assert torch.allclose(loaded.weights[name], w, atol=1e-6), (path.name, name)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_logits_match_transformers(tiny: Tiny, kernels: bool) -> None:
    built = load_kernels() if kernels else None
    assert built is not None or not kernels, "the C++ kernels failed to build"
    ids = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny.hf(ids[None]).logits[0]
    for path in tiny.paths:
        loaded = load_model(str(path))
        model = Gemma3Model(loaded.config, loaded.weights, torch.float32, ops=select_ops(built))
        plans = ([21], [5, 3, 10], [13, 5])  # chunks shorter and longer than the window
        diff = max((paged_logits(model, ids, c, kernels) - ref).abs().max().item() for c in plans)
        print(f"gemma3 {path.name} kernels={kernels}: max |diff| {diff:.1e}")
        assert diff < LOGIT_ATOL


PROMPT_LENS = [5, 11, 23, 30, 30]  # the last two share a 24-token prefix


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    out[-1][:24] = out[-2][:24]
    return out


def _check(name: str, refs: list[tuple[list[int], list[float]]], outs: list[Any]) -> None:
    for i, ((ref, gaps), out) in enumerate(zip(refs, outs, strict=True)):
        got = list(out.outputs[0].token_ids)
        assert len(got) == NEW_TOKENS, f"{name}: prompt {i} gave {len(got)} tokens"
        for step, (a, b) in enumerate(zip(ref, got, strict=True)):
            if a != b:
                assert gaps[step] < TIE_GAP, f"{name}: prompt {i} diverges at token {step}"
                break


def test_greedy_matches_transformers(tiny: Tiny, prompts: list[list[int]]) -> None:
    refs = [hf_greedy(tiny.hf, ids, NEW_TOKENS) for ids in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    path = str(tiny.paths[-1])
    llm = LLM(path, dtype="float32", block_size=4, num_blocks=64)
    _check("batch", refs, llm.generate(prompt_token_ids=prompts, sampling_params=sp))
    again = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert sum(o.num_cached_tokens for o in again) > 0, "expected prefix-cache hits"
    _check("prefix hits", refs, again)
    chunked = LLM(
        path, dtype="float32", block_size=4, num_blocks=64, max_num_batched_tokens=5,
        max_num_seqs=3,
    )  # fmt: skip
    _check("chunked", refs, chunked.generate(prompt_token_ids=prompts, sampling_params=sp))
    small = LLM(  # one table for all layers (hybrid preemption: test_hybrid_engine.py)
        path, dtype="float32", block_size=4, num_blocks=14, max_num_seqs=5,
        disable_hybrid_kv_cache_manager=True,
    )  # fmt: skip
    outs = small.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert small.engine.scheduler.num_preemptions_total > 0, "expected preemptions"
    _check("preempted", refs, outs)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
        ("hidden_activation", "gelu", "hidden_activation 'gelu'"),
        ("rope_scaling", {"rope_type": "linear", "factor": 8.0}, "RoPE scaling"),
    ],
)
def test_what_the_forward_cannot_run_is_refused(
    tiny: Tiny, tmp_path: Path, key: str, value: object, message: str
) -> None:
    import json
    import shutil

    folder = shutil.copytree(tiny.paths[0], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(folder))
