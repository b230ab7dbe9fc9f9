"""The hybrid KV manager in the engine: tiny random Gemma 3 (5 window layers per
global one), Qwen2 (one of two layers slides) and Mistral (every layer slides), W = 8,
block size 4, prompts longer than the window, float32.

Greedy tokens with one block table per group equal those with one table for all layers
(``--disable-hybrid-kv-cache-manager``, itself checked against transformers in
``test_sliding_window.py`` / ``test_gemma3.py``) batched, on prefix hits, in chunks
shorter and longer than the window, preempted, and with n-gram speculation; the window
groups hold fewer pages; per-token KV codecs and kivi2 under windows; ``check_integrity()``
after every step; offload tiers (logical blocks of every group's page); the radix prefix cache;
what is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.core.errors import InvalidRequestError
from kvstack.kv.codecs import CODECS
from kvstack.kv.hybrid import HybridKVManager
from kvstack.kv.manager import KVCacheManager
from kvstack.testing.families import tiny_family_config
from kvstack.testing.gemma3 import random_gemma3_weights, tiny_gemma3_config
from kvstack.testing.tiny_models import random_llama_weights, write_gguf

W = 8
BS = 4
NEW = 16
PROMPT_LENS = [5, 11, 23, 30, 30, 41]  # 30 and 30 share 24 tokens


def _gemma(tmp: Path) -> Path:
    cfg = tiny_gemma3_config(
        num_layers=6, window_layers=(True,) * 5 + (False,), query_pre_attn_scalar=256.0
    )
    return write_gguf(tmp / "gemma3.gguf", cfg, random_gemma3_weights(cfg, seed=3))


def _mistral(tmp: Path) -> Path:
    cfg = tiny_family_config("mistral", sliding_window=W)
    return write_gguf(tmp / "mistral.gguf", cfg, random_llama_weights(cfg, seed=11))


def _qwen2(tmp: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    del transformers
    from kvstack.testing.families import transformers_model, write_transformers_folder

    cfg = tiny_family_config("qwen2", sliding_window=W, window_layers=(False, True))
    hf = transformers_model(cfg, random_llama_weights(cfg, seed=11))
    return write_transformers_folder(tmp / "qwen2", hf, cfg.vocab_size)


MODELS = {"gemma3": _gemma, "mistral": _mistral, "qwen2": _qwen2}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return MODELS[request.param](tmp_path_factory.mktemp(f"hybrid-{request.param}"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    out[4][:24] = out[3][:24]
    out[5] = out[5][:10] * 4 + out[5][:1]  # repetitive: n-gram drafts
    return out


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def run(model: Path, prompts: list[list[int]], **opts: Any) -> tuple[list[list[int]], LLM]:
    """Generate step by step, checking the KV manager after every step."""
    llm = LLM(str(model), dtype="float32", block_size=BS, **{"num_blocks": 64, **opts})
    return [tokens for tokens, _ in steps(llm, prompts)], llm


def steps(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], dict[str, int]]]:
    """Each prompt's greedy tokens and cached-token split by tier, stepping the engine and
    checking the KV manager (and an offload connector) after every step."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(), prompt_token_ids=p)
    done: dict[str, tuple[list[int], dict[str, int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                split = dict(out.cached_tokens_by_tier or {})
                done[out.request_id] = (list(out.outputs[0].token_ids), split)
        engine.kv_manager.check_integrity()
        engine.kv_storage.codec.check_integrity()
        if engine.connector is not None:
            engine.connector.check_integrity()
    engine.scheduler.check_integrity()
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    tokens, llm = run(model, prompts, disable_hybrid_kv_cache_manager=True)
    assert isinstance(llm.engine.kv_manager, KVCacheManager)
    return tokens


def test_hybrid_tokens_equal_one_table(
    model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    tokens, llm = run(model, prompts)
    kv = llm.engine.kv_manager
    assert isinstance(kv, HybridKVManager)
    assert tokens == reference, "batched"
    again, _ = run(model, prompts + prompts)  # the second copy hits the first's blocks
    assert again == reference + reference, "prefix hits"
    for budget in (5, 13):
        chunked, _ = run(model, prompts, max_num_batched_tokens=budget, max_num_seqs=3)
        assert chunked == reference, f"chunks of {budget}"


def test_prefix_hits_are_taken(model: Path, prompts: list[list[int]]) -> None:
    llm = LLM(str(model), dtype="float32", block_size=BS, num_blocks=64)
    llm.generate(prompt_token_ids=prompts, sampling_params=greedy())
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy())
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [(n - 1) // BS * BS for n in PROMPT_LENS], cached
    llm.engine.kv_manager.check_integrity()


def test_window_groups_hold_fewer_pages(model: Path, prompts: list[list[int]]) -> None:
    """One long request: pages held at the end of decoding, hybrid vs one table."""
    long_prompt = [p for ps in prompts for p in ps][:120]
    held = {}
    for hybrid in (True, False):
        llm = LLM(str(model), dtype="float32", block_size=BS, num_blocks=64,
                  disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
        engine = llm.engine
        engine.add_request("r", None, greedy(), prompt_token_ids=long_prompt)
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.kv_manager.stats()
            peak = max(peak, stats.num_blocks - stats.num_free_blocks)
        groups = engine.kv_groups.num_groups if engine.kv_groups is not None else 1
        held[hybrid] = peak / groups  # in blocks of every layer
    assert held[True] < held[False], held
    assert held[False] == -(-(120 + NEW - 1) // BS)


def test_preemption_and_speculation(
    model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}  # fmt: skip
    tokens, llm = run(model, prompts, speculative_config=spec)
    assert tokens == reference, "speculative"
    stats = llm.engine.speculator.stats if llm.engine.speculator is not None else None
    assert stats is not None and stats.num_draft_tokens > 0
    # The smallest pool that holds the longest request (chunks of 8: a window group's
    # peak is its window plus one chunk), in blocks of every layer.
    probe = LLM(str(model), dtype="float32", block_size=BS, num_blocks=64,
                max_num_batched_tokens=8)  # fmt: skip
    groups = probe.engine.kv_groups
    assert groups is not None
    need = probe.engine.kv_manager.num_blocks_for(max(PROMPT_LENS) + NEW) + 1  # + null page
    tokens, llm = run(model, prompts, num_blocks=-(-need // groups.num_groups),
                      max_num_seqs=6, max_num_batched_tokens=8)  # fmt: skip
    assert tokens == reference, "small pool"
    if any(g.window is None for g in groups.groups):  # a full group grows while decoding
        assert llm.engine.scheduler.num_preemptions_total > 0, "expected preemptions"


@pytest.mark.parametrize("codec", ["int8", "rotated4"])
def test_per_token_codecs_with_windows(model: Path, prompts: list[list[int]], codec: str) -> None:
    """An encoded cache under the window (the codec kernel starts each row at its window):
    the hybrid manager gives the tokens of one table, in one batch and in chunks of 5."""
    one, _ = run(model, prompts, kv_cache_dtype=codec, disable_hybrid_kv_cache_manager=True)
    hybrid, llm = run(model, prompts, kv_cache_dtype=codec)
    assert isinstance(llm.engine.kv_manager, HybridKVManager)
    assert hybrid == one
    chunked, _ = run(model, prompts, kv_cache_dtype=codec, max_num_batched_tokens=5)
    assert chunked == one


@pytest.fixture(scope="module")
def gemma_interleaved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 with 2 global and 4 window layers (head_dim 256: kivi2 takes it): 3 groups
    of 2 layers, interleaved (layer 5 is the full group's slot 1, after group 2's slot 0)."""
    pytest.importorskip("transformers")  # the pattern lives in an HF folder's layer_types
    from kvstack.testing.families import write_transformers_folder
    from kvstack.testing.gemma3 import transformers_gemma3

    cfg = tiny_gemma3_config(
        num_layers=6, window_layers=(True, True, False, True, True, False),
        query_pre_attn_scalar=256.0,
    )  # fmt: skip
    hf = transformers_gemma3(cfg, random_gemma3_weights(cfg, seed=5))
    path = tmp_path_factory.mktemp("gemma-interleaved") / "hf"
    return write_transformers_folder(path, hf, cfg.vocab_size)


def test_kivi2_with_windows(
    gemma_interleaved: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kivi2 (a block encoded when it fills, its rows read exactly until then) keeps a write
    plan and residual slots per KV group: the hybrid manager gives one table's tokens in
    one batch, on prefix hits, in chunks of 5 and 13 and preempted in the smallest pool;
    the C++ codec kernel gives the PyTorch reference path's tokens."""
    model, kw = gemma_interleaved, {"kv_cache_dtype": "kivi2"}
    one, _ = run(model, prompts, disable_hybrid_kv_cache_manager=True, **kw)
    hybrid, llm = run(model, prompts, **kw)
    groups = llm.engine.kv_groups
    assert groups is not None and (groups.num_groups, groups.layers_per_page) == (3, 2)
    assert hybrid == one, "batched"
    again, _ = run(model, prompts + prompts, **kw)
    assert again == one + one, "prefix hits"
    for budget in (5, 13):
        chunked, _ = run(model, prompts, max_num_batched_tokens=budget, max_num_seqs=3, **kw)
        assert chunked == one, f"chunks of {budget}"
    need = llm.engine.kv_manager.num_blocks_for(max(PROMPT_LENS) + NEW) + 1
    small, tight = run(model, prompts, num_blocks=-(-need // groups.num_groups),
                       max_num_seqs=6, max_num_batched_tokens=8, **kw)  # fmt: skip
    assert small == one, "small pool"
    assert tight.engine.scheduler.num_preemptions_total > 0, "expected preemptions"
    monkeypatch.setattr(CODECS.get("kivi2"), "kernel_view", lambda self, layer, group=0: None)
    reference, _ = run(model, prompts, **kw)
    assert reference == one, "the reference path"


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offload_tiers_with_windows(
    model: Path, prompts: list[list[int]], reference: list[list[int]], tmp_path: Path, tier: str
) -> None:
    """Logical blocks (every group's page) written through to a tier and loaded back (a
    window group gets only its window's pages): the tokens of one table, in a roomy pool
    after the device cache was emptied and in the smallest pool (evictions, reloads)."""
    spec = "host:8MiB" if tier == "host" else f"disk:{tmp_path}:8MiB"
    llm = LLM(str(model), dtype="float32", block_size=BS, num_blocks=64, kv_offload=spec)
    assert isinstance(llm.engine.kv_manager, HybridKVManager)
    assert [t for t, _ in steps(llm, prompts)] == reference
    connector = llm.engine.connector
    assert connector is not None and connector.flush(30)
    llm.reset_prefix_cache()  # the device forgets; the tier keeps every block
    again = steps(llm, prompts)
    assert [t for t, _ in again] == reference, "loaded from the tier"
    for n, (_, split) in zip(PROMPT_LENS, again, strict=True):
        assert sum(split.values()) == (n - 1) // BS * BS, split
    assert sum(split[tier] for _, split in again) >= sum(PROMPT_LENS) // 2
    assert connector.num_loaded_blocks > 0
    probe = LLM(str(model), dtype="float32", block_size=BS, num_blocks=64,
                max_num_batched_tokens=8)  # fmt: skip
    groups = probe.engine.kv_groups
    assert groups is not None
    need = probe.engine.kv_manager.num_blocks_for(max(PROMPT_LENS) + NEW) + 1
    small = LLM(str(model), dtype="float32", block_size=BS, kv_offload=spec,
                num_blocks=-(-need // groups.num_groups), max_num_batched_tokens=8)  # fmt: skip
    for _ in range(2):
        assert [t for t, _ in steps(small, prompts + prompts)] == reference + reference
        assert small.engine.connector is not None and small.engine.connector.flush(30)


def test_radix_prefix_cache_with_windows(
    model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """--prefix-cache radix (a full group 0 in the token tree, window pages by key; a
    model whose every layer slides: tokens and tombstones in the tree, every page by key):
    the tokens of one table batched, on prefix hits (the hits the hash cache takes), in
    chunks and preempted in the smallest pool."""
    probe = LLM(str(model), dtype="float32", block_size=BS, num_blocks=64)
    groups = probe.engine.kv_groups
    assert groups is not None
    tokens, _ = run(model, prompts, prefix_cache="radix")
    assert tokens == reference, "batched"
    again, llm = run(model, prompts + prompts, prefix_cache="radix", max_num_seqs=1)
    assert again == reference + reference, "prefix hits"
    _, hashed = run(model, prompts + prompts, max_num_seqs=1)
    hits = llm.get_stats().prefix_hit_tokens
    least = sum((n - 1) // BS * BS for n in PROMPT_LENS)  # the second copy's hits
    assert hits == hashed.get_stats().prefix_hit_tokens >= least
    chunked, _ = run(model, prompts, prefix_cache="radix", max_num_batched_tokens=5)
    assert chunked == reference, "chunks of 5"
    need = probe.engine.kv_manager.num_blocks_for(max(PROMPT_LENS) + NEW) + 1
    pool = -(-need // groups.num_groups)
    small, tight = run(model, prompts, prefix_cache="radix", max_num_seqs=6, num_blocks=pool,
                       max_num_batched_tokens=8)  # fmt: skip
    assert small == reference, "small pool"
    assert tight.engine.scheduler.num_preemptions_total > 0, "expected preemptions"
    tiered = LLM(str(model), dtype="float32", block_size=BS, num_blocks=64,
                 prefix_cache="radix", kv_offload="host:8MiB")  # fmt: skip
    assert [t for t, _ in steps(tiered, prompts)] == reference
    assert tiered.engine.connector is not None and tiered.engine.connector.flush(30)
    tiered.reset_prefix_cache()
    loaded = steps(tiered, prompts)
    assert [t for t, _ in loaded] == reference, "loaded from the host tier"
    assert sum(split["host"] for _, split in loaded) >= sum(PROMPT_LENS) // 2


def test_what_the_hybrid_manager_refuses(model: Path, tmp_path: Path) -> None:
    # A pool of 2 blocks per layer holds one block of every group: the model's context is
    # lowered to one block at start, and a longer prompt is refused, never half-served.
    tiny = LLM(str(model), dtype="float32", num_blocks=2, block_size=BS)
    assert tiny.engine.max_model_len == BS
    with pytest.raises(InvalidRequestError, match=r"context length \(max_model_len\) is 4"):
        tiny.generate(prompt_token_ids=[list(range(3, 60))], sampling_params=greedy())
    llm = LLM(str(model), dtype="float32", num_blocks=32)
    with pytest.raises(InvalidRequestError, match="at least one full block"):
        llm.pin_prefix([3, 4, 5])
    with pytest.raises(InvalidRequestError, match="not supported by the hybrid KV manager"):
        llm.generate(prompt_token_ids=[list(range(3, 40))], sampling_params=greedy(),
                     segments=[[(4, 20)]])  # fmt: skip
    assert llm.pin_prefix(list(range(3, 40))) == 32  # computed first, then held
    assert llm.engine.kv_manager.num_pinned_blocks > 0
    llm.engine.kv_manager.check_integrity()
    one_table = LLM(str(model), dtype="float32", num_blocks=32, prefix_cache="radix",
                    disable_hybrid_kv_cache_manager=True)  # fmt: skip
    assert isinstance(one_table.engine.kv_manager, KVCacheManager)
