"""``decode_team`` (``csrc/decode_team.cpp``): a decode step's layers inside one parallel
region give ``decode_stack``'s and the Python loop's results bit for bit — the same tokens
and the same logprobs to the last bit — for bf16 (``bf16_linear``), int8 and int4
(``quant_gemv``) weights, rows long enough for the attention to split into partitions,
decodes beside short prefill chunks, n-gram verify rows and a sliding window; and a bad
index is refused before anything is written. Skipped where this CPU has no team
(``decode_team_supported``: AVX-512 with VNNI for quantized weights, AVX512-BF16 for bf16)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.model.arch import decode_stack
from kvstack.model.arch.decode_stack import AMX_LINEAR, BF16_LINEAR, QUANT_GEMV
from kvstack.model.kernels.loader import Kernels
from kvstack.model.kernels.packed_linear import tile_kernel
from kvstack.model.quant.linear import GEMV
from kvstack.testing.families import tiny_family_config
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

# head_dim 64 and 3 q heads per KV head, as SmolLM2; two prompts past 256 tokens (the
# attention cuts their rows into partitions and merges them)
PROMPTS = [[(7 * i + 3 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((9, 300, 40, 270))]
SP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 6, "num_kv_heads": 2,
         "head_dim": 64}  # fmt: skip


class Counting:
    """``torch.ops.kvstack`` with its ``decode_team`` / ``decode_stack`` calls counted."""

    def __init__(self, kernels: Any) -> None:
        self.kernels, self.n = kernels, {"decode_team": 0, "decode_stack": 0}

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.kernels, name)
        if name not in self.n:
            return op

        def counted(*a: Any, **kw: Any) -> Any:
            self.n[name] += 1
            return op(*a, **kw)

        return counted


def team_of(llm: LLM, quantization: str, k: Kernels) -> Counting:
    """The counted kernels of ``llm``'s stack (``k``: the ``kernels`` fixture, whose failed
    build fails the test). Skipped only where the kernels themselves say this CPU cannot
    run the team for these weights; where they can, the stack must exist and take the
    team."""
    tile = tile_kernel()
    if quantization == "none":  # the bf16 linears' kernel (packed_linear.tile_kernel)
        kind = AMX_LINEAR if tile is not None and tile.name == "amx" else BF16_LINEAR
        able = tile is not None
    else:
        kind, able = QUANT_GEMV, GEMV and bool(k.quant_gemv_ok(16, 32, 32, 4))
    if not (able and k.decode_team_supported([kind] * 8, 6, 2, 64)):
        pytest.skip(f"the kernels cannot run decode_team for {quantization} weights here")
    stack = llm.engine.runner.model.stack
    assert stack is not None and stack.team, f"{quantization}: the team is supported, not used"
    counting = Counting(stack.kernels)
    stack.kernels = counting
    return counting


def run(llm: LLM, path: str, prompts: list[list[int]], sp: SamplingParams) -> list[Any]:
    model = llm.engine.runner.model
    saved = model.stack
    model.stack = saved if path != "python" else None
    decode_stack.TEAM = path == "team"
    llm.reset_prefix_cache()
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    finally:
        model.stack, decode_stack.TEAM = saved, True
    llm.engine.check_integrity()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_team_equals_the_stack_and_the_python_loop(
    tmp_path: Path, quantization: str, kernels: Kernels
) -> None:
    cfg = tiny_llama_config(**SHAPE)
    path = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg, seed=3))
    llm = LLM(str(path), dtype="bfloat16", quantization=quantization, num_blocks=160,
              max_num_batched_tokens=48, block_size=8)  # fmt: skip
    calls = team_of(llm, quantization, kernels)
    want = run(llm, "python", PROMPTS, SP)
    assert run(llm, "stack", PROMPTS, SP) == want
    assert calls.n["decode_team"] == 0 and calls.n["decode_stack"] > 10
    assert run(llm, "team", PROMPTS, SP) == want
    assert calls.n["decode_team"] > 10  # decodes, alone and beside short chunks


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "rotated4", "kivi2"])
def test_team_takes_a_per_token_codec_bit_for_bit(
    tmp_path: Path, codec: str, kernels: Kernels
) -> None:
    """A per-token codec's step in the team (csrc/team_codec.h: the codec's write and its
    C++ attention as phases of the region) gives the Python loop's tokens and logprobs to
    the last bit; decode_stack does not take a codec, nor does the team take kivi2 (its
    residual pool is kept in Python)."""
    cfg = tiny_llama_config(**SHAPE)
    path = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg, seed=6))
    llm = LLM(str(path), dtype="bfloat16", kv_cache_dtype=codec, num_blocks=160,
              max_num_batched_tokens=48, block_size=16)  # fmt: skip
    calls = team_of(llm, "none", kernels)
    want = run(llm, "python", PROMPTS, SP)
    assert run(llm, "stack", PROMPTS, SP) == want
    assert calls.n["decode_stack"] == 0  # the Python loop ran those steps
    assert run(llm, "team", PROMPTS, SP) == want
    if codec == "kivi2":
        assert calls.n["decode_team"] == 0
    else:
        assert calls.n["decode_team"] > 10  # decodes, alone and beside short chunks


def test_verify_rows_and_a_window(tmp_path: Path, kernels: Kernels) -> None:
    cfg = tiny_family_config("mistral", sliding_window=40, **SHAPE)
    path = write_hf_folder(tmp_path / "mistral", cfg, random_llama_weights(cfg, seed=4))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(path), dtype="bfloat16", quantization="int4", num_blocks=160,
              speculative_config=spec, disable_hybrid_kv_cache_manager=True)  # fmt: skip
    calls = team_of(llm, "int4", kernels)
    repeating = [p[:6] * 12 for p in PROMPTS]  # prompt lookup finds drafts
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = run(llm, "python", repeating, greedy)
    assert run(llm, "team", repeating, greedy) == want
    assert calls.n["decode_team"] > 5
    assert llm.engine.stats().spec_decode["num_drafts"] > 0


def test_bad_indices_are_refused_before_any_write(tmp_path: Path, kernels: Kernels) -> None:
    cfg = tiny_llama_config(**SHAPE)
    path = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg, seed=5))
    llm = LLM(str(path), dtype="bfloat16", quantization="int8", num_blocks=32, block_size=8)
    team_of(llm, "int8", kernels)
    stack = llm.engine.runner.model.stack
    caches = [torch.zeros(32, 8, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    cos = torch.ones(64, 64)
    good: dict[str, Any] = {
        "positions": torch.tensor([3]), "slots": torch.tensor([3]),
        "tables": torch.tensor([[0, 1]]), "lens": torch.tensor([4]),
    }  # fmt: skip

    def call(codec: tuple[Any, ...] = ("", 0, [], [], None), kv: Any = caches, **bad: Any) -> None:
        a = {**good, **bad}
        stack.kernels.decode_team(
            torch.ones(1, 128, dtype=torch.bfloat16), stack.in_norms, stack.post_norms,
            *stack._args, a["positions"], cos, cos, kv, kv, a["slots"], a["tables"],
            None, a["lens"], 0.125, [0, 0], 6, 2, 64, 1e-5, *codec,
        )  # fmt: skip

    call()
    assert any(c.abs().sum() > 0 for c in caches)  # the good call wrote K and V
    for c in caches:
        c.zero_()
    for bad, match in [
        ({"slots": torch.tensor([256])}, "KV slot"),
        ({"positions": torch.tensor([64])}, "position"),
        ({"lens": torch.tensor([17])}, "context length"),
        ({"tables": torch.tensor([[0, 99]]), "lens": torch.tensor([12])}, "block id"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            call(**bad)
        assert all(c.abs().sum() == 0 for c in caches)  # nothing written
    # a codec's storage: kivi2 is outside the team; codes of another head count are refused
    codes = [torch.zeros(32, 8, 3, 64, dtype=torch.uint8) for _ in range(2)]
    params = [torch.zeros(32, 8, 3, 1, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(RuntimeError, match="outside its scope"):
        call(("kivi2", 0, params, params, None), codes)
    with pytest.raises(RuntimeError, match="codes hold 3 KV heads"):
        call(("int8", 0, params, params, None), codes)
    assert all(c.abs().sum() == 0 for c in codes)
