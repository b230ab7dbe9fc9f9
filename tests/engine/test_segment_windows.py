"""Segment reuse on a sliding-window model: a tiny random Gemma 3 (llama.cpp's
layer pattern: five local layers with a window of 8, one global), float32, block size 4,
one block table for all layers (``--disable-hybrid-kv-cache-manager``).

The prompt runs far past the window, so every repair row of a local layer must see only
the 8 keys up to its own position: ``PrefillSeq.mask_for`` builds that mask per row from
the rows' positions (a chunk's window mask, built from the last row back, gave the rows
the wrong keys once rows are scattered). Ratio 1.0 then gives a full prefill's logits,
and a partial repair scores the same through both row paths and returns every block.
The hybrid KV manager refuses marks with a message that names the flag."""

from __future__ import annotations

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.core.errors import InvalidRequestError
from kvstack.engine.segments import automatic_segments
from kvstack.model import runner, segment_rows
from kvstack.testing.gemma3 import random_gemma3_weights, tiny_gemma3_config
from kvstack.testing.tiny_models import write_gguf

OPTS = {"dtype": "float32", "block_size": 4, "num_blocks": 128}


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = tiny_gemma3_config(
        num_layers=6, window_layers=(True,) * 5 + (False,), query_pre_attn_scalar=256.0
    )
    path = tmp_path_factory.mktemp("gemma3-seg") / "m.gguf"
    return str(write_gguf(path, cfg, random_gemma3_weights(cfg, seed=5)))


def prompt() -> tuple[list[int], list[list[int]], int]:
    """Head 9, segments of 13 and 11 tokens, tail 12: ids, marks, first scored position."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 300, (45,), generator=g).tolist()
    return ids, [[9, 22], [22, 33]], 34


def test_full_recompute_equals_full_prefill(gguf: str) -> None:
    ids, marks, start = prompt()
    ref = LLM(gguf, segment_cache="none", **OPTS).score(ids, start=start).float()
    llm = LLM(gguf, disable_hybrid_kv_cache_manager=True, segment_recompute_ratio=1.0, **OPTS)
    llm.score(ids, start=start, segments=marks)  # computes the entries
    got = llm.score(ids, start=start, segments=marks).float()  # copies, recomputes all
    seg = llm.get_stats().segments
    assert seg["placed_tokens"] == 2 * 24 and seg["recomputed_tokens"] > 0
    # (score returns float16 log-probabilities: one ulp at |x| < 8 is 0.0039)
    assert torch.allclose(got, ref, atol=8e-3), float((got - ref).abs().max())
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(gguf, segment_cache="none", **OPTS)
    want = plain.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)
    outs = llm.generate(
        prompt_token_ids=[ids], sampling_params=sp, segments=[marks], use_tqdm=False,
        check_integrity=True,
    )  # fmt: skip
    assert outs[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def _partial(gguf: str) -> torch.Tensor:
    """A partial repair's scores (rows at scattered positions), every block returned."""
    ids, marks, start = prompt()
    llm = LLM(
        gguf, disable_hybrid_kv_cache_manager=True, segment_recompute_ratio=0.3,
        segment_recompute_tokens=2, **OPTS,
    )  # fmt: skip
    llm.score(ids, start=start, segments=marks)
    lp = llm.score(ids, start=start, segments=marks).float()
    assert llm.get_stats().segments["hit_tokens"] == 24
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    return lp


def test_partial_repair_rows_see_their_own_windows(
    gguf: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scattered repair rows scored by the C++ paged kernel (each row's window from its
    context length) and as one sparse SDPA sequence (``mask_for``'s per-row window mask:
    the bf16 path, and every CPU without the kernels) give the same scores; with the
    chunk's window mask the second differed by 0.73 nats."""
    paged = _partial(gguf)
    no = lambda *args: False  # noqa: E731
    monkeypatch.setattr(segment_rows, "rows_on_paged_kernel", no)
    monkeypatch.setattr(runner, "rows_on_paged_kernel", no)
    sparse = _partial(gguf)
    assert torch.allclose(paged, sparse, atol=8e-3), float((paged - sparse).abs().max())


def test_hybrid_manager_refuses_marks_naming_the_flag(gguf: str) -> None:
    llm = LLM(gguf, **OPTS)  # a window: the hybrid KV manager
    ids, marks, start = prompt()
    with pytest.raises(InvalidRequestError, match="--disable-hybrid-kv-cache-manager"):
        llm.score(ids, start=start, segments=marks)
    assert llm.engine.num_free_blocks == llm.engine.kv_manager.num_blocks
    # the server turns tools into segments only where they can be placed
    assert not automatic_segments(llm.engine)
    one_table = LLM(gguf, disable_hybrid_kv_cache_manager=True, **OPTS)
    assert automatic_segments(one_table.engine)
