"""Presses against their reference: kvpress 0.5.5's scoring re-implemented exactly, on a tiny
random model, must keep the same positions as kvstack; and a press's observation window,
hence its kept set, must not depend on how the prompt was computed.

``kvpress_*`` below transcribe NVIDIA kvpress 0.5.5 (``presses/{streaming_llm,knorm,snapkv,
pyramidkv,scorer}_press.py`` and ``utils.compute_n_kept``) in its layout (``[batch, heads,
tokens, head_dim]``), operation for operation. They score the keys and window queries the
engine handed its press (``PressInput``), and those are checked separately against Hugging
Face transformers running the same weights (the last ``window`` prompt rows, post-RoPE, as
kvpress computes them from the attention input). ``benchmarks/presses_vs_kvpress.py`` runs
kvpress itself on the default model.

Not compared: kvstack's H2O is not kvpress's ``ObservedAttentionPress`` (every query's
attention normalized by how many queries see a token, no recent half), and kvpress has no
DefensiveKV; both still get the window test.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvstack import LLM, SamplingParams
from kvstack.kv.press import PRESSES, PressInput
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

# 400 prompt tokens: every budget here is at least the 64-token window (below it kvpress
# keeps whichever window tokens its top-k's tie-break picks, kvstack the last ones).
NUM_LAYERS, PROMPT = 4, 400
Kept = list[list[set[int]]]  # per layer, per KV head


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config(num_layers=NUM_LAYERS, max_position_embeddings=1024)
    weights = random_llama_weights(cfg, seed=5)
    return write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, weights)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(3, 320, (PROMPT,), generator=g).tolist()


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[PressInput, Kept]]]:
    """Every ``Press.select`` call: its input and the kept positions it returned."""
    calls: list[tuple[PressInput, Kept]] = []
    owners = {  # the classes that define the ``select`` each press runs (wrapped once)
        next(c for c in PRESSES.get(n).__mro__ if "select" in c.__dict__) for n in PRESSES
    }
    for cls in owners:
        inner = cls.select

        def select(self: Any, inp: PressInput, _inner: Any = inner) -> list[torch.Tensor]:
            out = _inner(self, inp)
            calls.append((inp, [[set(h.tolist()) for h in layer] for layer in out]))
            return out

        monkeypatch.setattr(cls, "select", select)
    yield calls


def greedy(press: str, ratio: float, **kw: Any) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True, kv_press=press, kv_press_ratio=ratio, **kw
    )


# ---------------------------------------------------------------------------- kvpress 0.5.5


def kvpress_n_kept(k_len: int, ratio: float) -> int:  # utils.compute_n_kept
    return max(1, int(k_len * (1 - ratio)))


def kvpress_streaming_scores(keys: torch.Tensor, ratio: float, n_sink: int = 4) -> torch.Tensor:
    k_len = keys.shape[2]
    n_pruned = k_len - int(k_len * (1 - ratio))
    scores = torch.ones_like(keys[..., 0])
    scores[:, :, n_sink : n_sink + n_pruned] = 0
    return scores


def kvpress_knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    return -torch.linalg.vector_norm(
        keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32)
    )


def kvpress_snapkv_scores(
    queries: torch.Tensor, keys: torch.Tensor, window: int = 64, kernel: int = 5
) -> torch.Tensor:
    """``SnapKVPress.score`` from the post-RoPE window queries ``[1, heads, window, d]``."""
    bsz, num_kv, k_len, head_dim = keys.shape
    groups = queries.shape[1] // num_kv
    key_states = keys.repeat_interleave(groups, dim=1)  # transformers' repeat_kv
    attn = torch.matmul(queries, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    mask = torch.triu(torch.ones_like(attn) * float("-inf"), diagonal=k_len - window + 1)
    attn += mask
    attn = F.softmax(attn, dim=-1, dtype=torch.float32).to(queries.dtype)
    attn = attn[..., :-window]
    scores = attn.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(bsz, num_kv, groups, k_len - window).mean(2)
    return F.pad(scores, (0, window), value=scores.max().item() + 1)


def kvpress_pyramid_budget(layer: int, num_layers: int, q_len: int, ratio: float,
                           window: int = 64, beta: int = 20) -> int:  # fmt: skip
    max_capacity_prompt = window + q_len * (1 - ratio)
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return max(1, round(q_len * (1 - ratio)))
    steps = (max_num - min_num) / (num_layers - 1) if num_layers > 1 else 0.0
    return round(max_num - layer * steps)


def kvpress_kept(press: str, ratio: float, inp: PressInput) -> Kept:
    """kvpress's kept positions per layer and head on ``inp`` (what kvstack scored)."""
    out = []
    for layer in range(inp.num_layers):
        keys = inp.keys[layer].permute(1, 0, 2)[None]  # [1, kv_heads, n, d]
        n = keys.shape[2]
        n_kept = kvpress_n_kept(n, ratio)
        if press == "streaming_llm":
            scores = kvpress_streaming_scores(keys, ratio)
        elif press == "knorm":
            scores = kvpress_knorm_scores(keys)
        else:
            assert inp.queries is not None and inp.queries[layer].shape[0] == 64
            queries = inp.queries[layer].permute(1, 0, 2)[None]  # [1, heads, 64, d]
            scores = kvpress_snapkv_scores(queries, keys)
            if press == "pyramidkv":
                n_kept = kvpress_pyramid_budget(layer, inp.num_layers, n, ratio)
        idx = scores.topk(n_kept, dim=-1).indices[0]
        out.append([set(h.tolist()) for h in idx])
    return out


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("press", ["streaming_llm", "snapkv", "knorm", "pyramidkv"])
@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8])
def test_kept_positions_are_kvpress(
    tiny_path: Path, prompt: list[int], record: list[Any], press: str, ratio: float
) -> None:
    """Identical kept sets on every (layer, KV head), budgets included (PyramidKV's
    pyramid at 0.3 / 0.5, kvpress's uniform fallback at 0.8)."""
    llm = LLM(str(tiny_path), dtype="float32", num_blocks=64, block_size=16)
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(press, ratio))
    assert len(record) == 1
    inp, ours = record[0]
    assert inp.n == PROMPT
    theirs = kvpress_kept(press, ratio, inp)
    assert [len(layer[0]) for layer in ours] == [len(layer[0]) for layer in theirs]
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for head, (sa, sb) in enumerate(zip(a, b, strict=True)):
            assert sa == sb, f"{press}@{ratio} layer {layer} head {head}: {sorted(sa ^ sb)}"
    if press == "pyramidkv":
        sizes = [len(layer[0]) for layer in ours]
        assert (sizes[0] > sizes[-1]) == (ratio < 0.8)


def test_press_inputs_are_what_kvpress_computes(
    tiny_path: Path, prompt: list[int], record: list[Any]
) -> None:
    """The keys and the window queries a press scores are transformers' on the same weights:
    post-RoPE keys of every prompt token, and the queries of the *last 64* prompt tokens,
    computed as kvpress does (``q_proj`` of the attention input, then RoPE)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import rotate_half

    llm = LLM(str(tiny_path), dtype="float32", num_blocks=64, block_size=16)
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy("snapkv", 0.5))
    inp, _ = record[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_path), dtype=torch.float32
    ).eval()
    seen: dict[int, torch.Tensor] = {}

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        hidden = kwargs["hidden_states"][:, -64:]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(1, 64, -1, module.head_dim).transpose(1, 2)
        cos, sin = cos[:, -64:].unsqueeze(1), sin[:, -64:].unsqueeze(1)
        seen[module.layer_idx] = q * cos + rotate_half(q) * sin

    handles = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        with torch.inference_mode():
            out = model(torch.tensor([prompt]), use_cache=True)
    finally:
        for h in handles:
            h.remove()
    assert inp.queries is not None
    for layer in range(NUM_LAYERS):
        want_q = seen[layer][0].permute(1, 0, 2)  # [64, heads, d]
        assert inp.queries[layer].shape == want_q.shape
        torch.testing.assert_close(inp.queries[layer], want_q, atol=2e-5, rtol=1e-4)
        want_k = out.past_key_values.layers[layer].keys[0].permute(1, 0, 2)  # [n, kvh, d]
        torch.testing.assert_close(inp.keys[layer], want_k, atol=2e-5, rtol=1e-4)


# How the prompt reaches the press point: engine options and a warm-up request that fills
# the prefix cache with the same prompt (or with its first 200 tokens).
WAYS = {
    "fresh": ({"max_num_batched_tokens": 1024}, None),
    "chunks of 1": ({"max_num_batched_tokens": 1}, None),
    "chunks of 7": ({"max_num_batched_tokens": 7}, None),
    "chunks of 64": ({"max_num_batched_tokens": 64}, None),
    "chunks of 65": ({"max_num_batched_tokens": 65}, None),
    "chunks of 390": ({"max_num_batched_tokens": 390}, None),
    "prefix cache": ({"max_num_batched_tokens": 1024}, PROMPT),
    "prefix cache, then chunks of 10": ({"max_num_batched_tokens": 10}, PROMPT),
    "partial prefix cache": ({"max_num_batched_tokens": 1024}, 200),
}


@pytest.mark.parametrize(
    ("press", "after"),
    [
        ("snapkv", None),
        ("h2o", 250),
        pytest.param("snapkv", 250, marks=pytest.mark.slow),
        pytest.param("pyramidkv", None, marks=pytest.mark.slow),
        pytest.param("h2o", None, marks=pytest.mark.slow),
        pytest.param("defensivekv", None, marks=pytest.mark.slow),
    ],
)
def test_kept_set_is_independent_of_prefix_hits_and_chunking(
    tiny_path: Path, prompt: list[int], record: list[Any], press: str, after: int | None
) -> None:
    """The same request keeps the same positions however its prompt was computed: fresh,
    in chunks of any size, after a prefix-cache hit (whole prompt or part of it), also
    when pressing before the prompt's end (``kv_press_after``). The press always gets the
    queries of the last ``window`` tokens before its point."""
    window = PRESSES.get(press).window
    point = after or PROMPT
    kept: dict[str, Kept] = {}
    for way, (options, warm) in WAYS.items():
        llm = LLM(str(tiny_path), dtype="float32", num_blocks=96, block_size=16, **options)
        if warm is not None:
            llm.generate(
                prompt_token_ids=[prompt[:warm]], sampling_params=SamplingParams(max_tokens=1)
            )
            assert len(record) == 0
        llm.generate(
            prompt_token_ids=[prompt],
            sampling_params=greedy(press, 0.5, kv_press_after=after),
            check_integrity=True,
        )
        if warm is not None and point - window >= 16:  # at least one block before the window
            assert llm.get_stats().prefix_hit_tokens > 0, f"{way}: no prefix hit"
        assert len(record) == 1, way
        inp, kept[way] = record.pop()
        assert inp.n == point
        assert inp.queries is not None
        assert {q.shape[0] for q in inp.queries} == {min(window, point)}, way
        assert llm.get_stats().press_skipped == dict.fromkeys(
            ("no_free_blocks", "window_incomplete", "error"), 0
        )
    for way, k in kept.items():
        assert k == kept["fresh"], f"{press}: {way} keeps other positions than a fresh prompt"
