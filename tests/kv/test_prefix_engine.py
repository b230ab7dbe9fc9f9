"""Prefix reuse on the real default model: it must never change greedy outputs (fp32).

The pool is kept small so that requests are preempted and cached blocks are evicted
while others reuse them; every configuration must give the tokens of a plain run.
"""

from __future__ import annotations

import pytest

from kvstack import LLM, SamplingParams
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.kv.events import BlockRemoved, BlockStored

SYSTEM = (
    "You are a careful assistant for a public library. Answer questions about opening "
    "hours, borrowing rules, late fees, room bookings and the reading clubs. Be brief, "
    "polite and exact, and say when you do not know something."
)
QUESTIONS = [
    "When does the library open on Sundays?",
    "How many books can I borrow at once?",
    "What is the fee for a late DVD?",
    "Can I book a study room for four people?",
    "Is there a reading club for teenagers?",
    "Do you lend e-readers to members?",
]
SP = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(llm: LLM) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        ids = llm.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=True,
        )
        assert isinstance(ids, list)
        out.append(ids)
    # A follow-up turn that resends the first conversation (multi-turn reuse).
    out.append(out[0] + llm.tokenizer.encode(" And on Mondays?", add_special_tokens=False))
    return out


def run_waves(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    """Two waves, so the second reuses what the first cached (or had evicted)."""
    first = llm.generate(prompt_token_ids=ps[:3], sampling_params=SP, check_integrity=True)
    second = llm.generate(prompt_token_ids=ps[3:], sampling_params=SP, check_integrity=True)
    eng = llm.engine
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks - eng.kv_manager.num_pinned_blocks
    return [o.outputs[0].token_ids for o in first + second]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM("default", dtype="float32", prefix_cache="none", num_blocks=200)
    ps = prompts(llm)
    return ps, run_waves(llm, ps)


@pytest.mark.parametrize(
    ("cache", "policy"), [("hash", "lru"), ("radix", "lru"), ("hash", "adaptive"), ("radix", "lfu")]
)
@pytest.mark.slow
def test_reuse_under_pressure_keeps_greedy_tokens(
    reference: tuple[list[list[int]], list[list[int]]], cache: str, policy: str
) -> None:
    ps, want = reference
    # 10 blocks of 16 = 160 slots for prompts of ~75 tokens sharing ~4 blocks, so the
    # scheduler preempts and the cache evicts while sharing the system prompt.
    llm = LLM(
        "default",
        dtype="float32",
        prefix_cache=cache,
        eviction_policy=policy,
        num_blocks=10,
        max_num_seqs=4,
        max_model_len=160,  # all the pool holds for one sequence
    )
    assert run_waves(llm, ps) == want
    s = llm.get_stats()
    assert s.prefix_hit_tokens > 0 and s.num_evicted_blocks > 0 and s.num_preemptions > 0
    assert s.prefill_tokens_computed < sum(len(p) for p in ps)


@pytest.mark.slow
def test_cached_tokens_pins_events_and_reset(
    reference: tuple[list[list[int]], list[list[int]]],
) -> None:
    ps, want = reference
    llm = LLM("default", dtype="float32", num_blocks=40, max_num_seqs=4)
    shared = 0
    while ps[0][shared] == ps[1][shared]:
        shared += 1
    pinned = llm.pin_prefix(ps[0][:shared])
    assert pinned == shared // 16 * 16 and llm.engine.kv_manager.num_pinned_blocks == shared // 16
    outs = llm.generate(prompt_token_ids=ps, sampling_params=SP, check_integrity=True)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens >= pinned for o in outs)
    assert outs[-1].num_cached_tokens >= len(ps[0]) // 16 * 16  # the follow-up turn
    assert all(o.metrics is not None and o.metrics.ttft is not None for o in outs)
    events = llm.engine.kv_events.drain().events
    assert any(isinstance(e, BlockStored) for e in events)
    # Flood the small pool: the pin survives, other prefixes are evicted.
    flood = [[300 + i] * 150 + [7] for i in range(4)]
    llm.generate(prompt_token_ids=flood, sampling_params=SP, check_integrity=True)
    assert any(isinstance(e, BlockRemoved) for e in llm.engine.kv_events.drain().events)
    again = llm.generate(prompt_token_ids=[ps[2]], sampling_params=SP)[0]
    assert again.num_cached_tokens >= pinned
    with pytest.raises(InvalidRequestError, match="at most"):
        llm.pin_prefix([5] * 16 * 30)  # more blocks than pins may hold
    assert llm.unpin_prefix(ps[0][:shared]) and not llm.unpin_prefix(ps[0][:shared])
    llm.reset_prefix_cache()
    cold = llm.generate(prompt_token_ids=[ps[2]], sampling_params=SP)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == want[2]
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == 40


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "contiguous-request"])
def test_contiguous_layout_same_tokens_more_waste(
    reference: tuple[list[list[int]], list[list[int]]], layout: str
) -> None:
    ps, want = reference
    llm = LLM("default", dtype="float32", kv_layout=layout, num_blocks=40, max_model_len=256)
    assert run_waves(llm, ps) == want
    s = llm.get_stats()
    assert s.prefix_hit_tokens == 0 and s.kv_waste_avg > 0
    # 40 blocks hold two 256-token slabs, so at most 2 requests ran at once.
    if layout == "contiguous":
        assert s.max_num_running == 2


def test_bad_cache_options_are_rejected() -> None:
    with pytest.raises(ConfigError, match="lru, lfu, adaptive"):
        LLM("default", eviction_policy="belady")
    with pytest.raises(ConfigError, match="power of two"):
        LLM("default", block_size=24)
    with pytest.raises(ConfigError, match="prefix_cache"):
        LLM("default", prefix_cache="trie")
    with pytest.raises(ConfigError, match="exceeds max_model_len"):
        LLM("default", block_size=64, max_model_len=32)
    llm = LLM("default", prefix_cache="none", num_blocks=8)
    with pytest.raises(InvalidRequestError, match="prefix cache"):
        llm.pin_prefix("some system prompt that is long enough to fill a block or two")
