"""Presses on sliding-window models: the full-attention layers are pressed, as
kvpress does on Gemma 3 (its sliding layers are skipped), and each window layer keeps
its window (``kv/press/compact.py``).

The reference is independent of kvstack's press code: transformers' Gemma 3 on the same
weights, given per-layer-type attention masks in which every row after the prompt sees,
in the full-attention layers, only the prompt tokens StreamingLLM keeps (its sinks and
last tokens) and the tokens generated since, and in the sliding layers its usual window.
kvstack's greedy tokens must equal it with the hybrid KV manager and with one table, when
the full layers keep more tokens than a window (the C++ kernels read the compacted
tables) and fewer (the full layers mask their extra slots). Then other presses, chunked
prefill, prefix hits, preemption and codecs give one table's tokens with the hybrid
manager, ``check_integrity()`` after every step, and pressed requests hold fewer pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.kv.hybrid import HybridKVManager
from kvstack.kv.manager import KVCacheManager
from kvstack.model.kernels.loader import load_kernels
from kvstack.testing.gemma3 import random_gemma3_weights, tiny_gemma3_config

W, BS, NEW = 8, 4, 12
PROMPT_LENS = [30, 23, 41, 17]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Tiny Gemma 3: 4 window layers and 2 global ones, interleaved (3 KV groups of 2)."""
    pytest.importorskip("transformers")
    from kvstack.testing.families import write_transformers_folder
    from kvstack.testing.gemma3 import transformers_gemma3

    cfg = tiny_gemma3_config(
        num_layers=6, window_layers=(True, True, False, True, True, False),
        sliding_window=W, query_pre_attn_scalar=256.0,
    )  # fmt: skip
    hf = transformers_gemma3(cfg, random_gemma3_weights(cfg, seed=9))
    path = tmp_path_factory.mktemp("window-press") / "hf"
    return write_transformers_folder(path, hf, cfg.vocab_size), hf


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    out = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    out[1][:16] = out[0][:16]  # a shared prefix: prefix hits
    return out


def sp(press: str, ratio: float) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, kv_press=press, kv_press_ratio=ratio
    )


def run(path: Path, prompts: list[list[int]], params: SamplingParams, **opts: Any) -> Any:
    """Each prompt's greedy tokens, stepping the engine and checking the KV manager, the
    codec and the press coordinator after every step; and the LLM."""
    llm = LLM(str(path), dtype="float32", block_size=BS, **{"num_blocks": 96, **opts})
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=p)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        engine.kv_manager.check_integrity()
        engine.kv_storage.codec.check_integrity()
        engine.press.check_integrity(engine.scheduler.requests)
    engine.scheduler.check_integrity()
    return [done[f"r{i}"] for i in range(len(prompts))], llm


def streaming_rows(n: int, ratio: float, every: int | None) -> dict[int, list[int]]:
    """Per decode row (position ``q >= n``), the positions StreamingLLM leaves the full
    layers: its 4 sinks and the last tokens of the prompt (kvpress's ``compute_n_kept``),
    then every token decoded; with ``every``, the engine's re-press (once the slots reach
    the first press's ``M + every``: the same sinks and the last tokens of what is left,
    ``kv/press/coordinator.py``), ``M`` = max(budget, a window layer's ``W - 1``)."""
    m = max(1, int(n * (1 - ratio)))
    sinks = min(4, m)

    def streaming(pos: list[int]) -> list[int]:
        return pos[:sinks] + (pos[len(pos) - (m - sinks) :] if m > sinks else [])

    seen, slots = streaming(list(range(n))), max(m, min(n, W - 1))
    budget, rows = slots, {}
    for q in range(n, n + NEW - 1):
        seen = [*seen, q]
        rows[q] = seen
        slots += 1
        if every is not None and slots >= budget + every:
            seen, slots = streaming(seen), budget
    return rows


def reference_logprobs(
    hf: Any, prompt: list[int], tokens: list[int], rows: dict[int, list[int]] | None
) -> Any:
    """transformers' log-probabilities of ``tokens`` generated after ``prompt`` (teacher
    forced) when decode row ``q`` sees only ``rows[q]`` in the full-attention layers
    (None: everything) and the sliding layers their window: ``[len(tokens)]``."""
    n, ids = len(prompt), prompt + tokens
    t = len(ids) - 1  # the last token is never an input
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    causal = k <= q
    full = causal.clone()
    for row, seen in (rows or {}).items():
        full[row] = False
        full[row, seen] = True
    sliding = causal & (k > q - W)
    masks = {
        name: torch.zeros(1, 1, t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
        for name, allowed in (("full_attention", full), ("sliding_attention", sliding))
    }
    with torch.inference_mode():
        logits = hf(torch.tensor([ids[:t]]), attention_mask=masks).logits[0, n - 1 :]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


# Full layers keep 15 (>= W - 1: the kernels read the compacted tables) or 3 (< W - 1:
# they mask their extra slots); pressed once, or again every 3 decoded tokens.
@pytest.mark.parametrize("every", [None, 3])
@pytest.mark.parametrize("ratio", [0.5, 0.9])
def test_streaming_llm_is_transformers_with_its_masks(
    gemma: tuple[Path, Any], prompts: list[list[int]], ratio: float, every: int | None
) -> None:
    """Each generated token's log-probability equals transformers' under the press's masks
    (1e-4), and differs from transformers' without a press."""
    path, hf = gemma
    hf.config._attn_implementation = "eager"  # additive masks, as given
    prompt = prompts[0]
    rows = streaming_rows(len(prompt), ratio, every)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0,
                            kv_press="streaming_llm", kv_press_ratio=ratio,
                            kv_press_every=every)  # fmt: skip
    for opts in ({}, {"disable_hybrid_kv_cache_manager": True}):
        llm = LLM(str(path), dtype="float32", block_size=BS, num_blocks=96, **opts)
        kind = KVCacheManager if opts else HybridKVManager
        assert isinstance(llm.engine.kv_manager, kind)
        (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        tokens = list(out.outputs[0].token_ids)
        steps = zip(out.outputs[0].logprobs or [], tokens, strict=True)
        got = torch.tensor([lp[t].logprob for lp, t in steps])
        want = reference_logprobs(hf, prompt, tokens, rows)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=str(opts))
        unpressed = reference_logprobs(hf, prompt, tokens, None)
        assert (got[1:] - unpressed[1:]).abs().max() > 1e-3, "the press changed nothing"
        stats = llm.engine.stats()
        assert stats.num_pressed_requests == 1 and stats.num_press_dropped_tokens > 0
        assert (stats.num_represses >= 3) == (every is not None), stats.num_represses
        llm.engine.kv_manager.check_integrity()


@pytest.mark.parametrize(("press", "every"), [("snapkv", None), ("pyramidkv", None),
                                              ("knorm", None), ("snapkv", 4)])  # fmt: skip
def test_hybrid_manager_gives_one_tables_tokens(
    gemma: tuple[Path, Any], prompts: list[list[int]], press: str, every: int | None
) -> None:
    """Batched, on prefix hits, in chunks, preempted and with a KV codec, the hybrid
    manager's pressed tokens are one table's (pressed once, or again every 4 tokens)."""
    path, _ = gemma
    params = sp(press, 0.6)
    params.kv_press_every = every
    one, _ = run(path, prompts, params, disable_hybrid_kv_cache_manager=True)
    hybrid, llm = run(path, prompts, params)
    assert hybrid == one, "batched"
    assert llm.engine.stats().num_pressed_requests == len(prompts)
    again, _ = run(path, prompts + prompts, params)
    assert again == one + one, "prefix hits"
    chunked, _ = run(path, prompts, params, max_num_batched_tokens=5, max_num_seqs=2)
    assert chunked == one, "chunks of 5"
    small, tight = run(path, prompts, params, num_blocks=12, max_num_batched_tokens=8)
    assert small == one, "small pool"
    assert tight.engine.scheduler.num_preemptions_total > 0, "expected preemptions"
    # With a codec, both managers in chunks of 13; kivi2 also against one whole prefill
    # where the C++ kernel runs (every kivi2 prefill row takes it: its rows' sums do not
    # follow the chunk's shape; through masked SDPA, last-bit differences became 2-bit
    # code flips and knorm picked other tokens, Zen 5, 2026-12-04).
    for codec in ("int8", "kivi2"):
        a, _ = run(path, prompts, params, kv_cache_dtype=codec, max_num_batched_tokens=13,
                   disable_hybrid_kv_cache_manager=True)  # fmt: skip
        b, _ = run(path, prompts, params, kv_cache_dtype=codec, max_num_batched_tokens=13)
        assert a == b, codec
    if load_kernels() is not None:
        whole, _ = run(path, prompts, params, kv_cache_dtype="kivi2")
        assert whole == b, "kivi2: chunks of 13 vs one prefill"


def test_pressed_requests_hold_fewer_pages(gemma: tuple[Path, Any]) -> None:
    """A 60-token prompt that knorm presses to 12 tokens in the full group holds fewer
    pages than the same prompt unpressed (the window groups hold their windows' pages
    either way)."""
    path, _ = gemma
    prompt = list(range(5, 65))
    llm = LLM(str(path), dtype="float32", block_size=BS, num_blocks=96)
    engine = llm.engine
    kv = engine.kv_manager
    assert isinstance(kv, HybridKVManager)
    for name, params in (("plain", SamplingParams(max_tokens=NEW, ignore_eos=True)),
                         ("pressed", sp("knorm", 0.8))):  # fmt: skip
        engine.add_request(name, None, params, prompt_token_ids=prompt)
    held: dict[str, int] = {}
    while engine.has_unfinished_requests():
        engine.step()
        kv.check_integrity()
        for rid in kv.held_request_ids():
            held[rid] = kv.num_held_pages(rid)
    assert held["pressed"] < held["plain"], held
