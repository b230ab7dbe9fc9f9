"""A request that makes a model step raise fails alone (``kvstack/step_isolation.py``).

A sampler hook raises for one request of a batch of 8 (tiny random Llama, float32): its
7 batch mates finish with the tokens of their solo runs (greedy and seeded sampling),
the bad one gets the error, the prefix cached before the step and its pin survive, no
KV block leaks, and the bisection re-runs the step at most ``log2(8) + 2`` times.
Before, every request of the step failed and the prefix cache was emptied.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstack import LLM, SamplingParams
from kvstack.engine.llm_engine import LLMEngine
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf

BAD = "bad"
PREFIX = [(7 * i) % 300 + 10 for i in range(80)]  # 5 blocks of 16, cached and pinned


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_gguf(path, cfg, random_llama_weights(cfg))
    return path


@pytest.fixture
def llm(gguf: Path) -> Iterator[LLM]:
    yield LLM(str(gguf), dtype="float32", num_blocks=96, max_model_len=128, max_num_seqs=8)


def prompt(i: int) -> list[int]:
    return [(13 * i + 5 * j) % 300 + 10 for j in range(20 + i)]


def params(i: int) -> SamplingParams:
    """Even requests greedy, odd ones seeded sampling."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True)


def run(eng: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Add ``requests`` together and step until all finish: id -> tokens or error."""
    for rid, (ids, sp) in requests.items():
        eng.add_request(rid, ids, sp)
    done: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = out.error or c.token_ids
                assert (out.error is None) == (c.finish_reason != "error")
    return done


def poison(eng: LLMEngine, monkeypatch: pytest.MonkeyPatch, bad: str = BAD) -> list[int]:
    """Make sampling raise whenever request ``bad`` samples; count the runner's runs."""
    runner, calls = eng.runner, [0]
    sample, execute = runner._sample, runner.execute

    def bad_sample(logits: Any, plan: Any, result: Any) -> None:
        if any(r.request_id == bad for r in plan.sample_reqs):
            raise RuntimeError("sampling exploded for one row")
        sample(logits, plan, result)

    def counted(out: Any) -> Any:
        calls[0] += 1
        return execute(out)

    monkeypatch.setattr(runner, "_sample", bad_sample)
    monkeypatch.setattr(runner, "execute", counted)
    return calls


def assert_clean(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert not eng.has_unfinished_requests()
    kv = eng.kv_manager
    assert eng.num_free_blocks == kv.num_blocks - kv.num_pinned_blocks, "KV blocks leaked"


def test_a_bad_request_fails_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = llm.engine
    llm.generate([PREFIX], SamplingParams(max_tokens=1))
    assert llm.pin_prefix(PREFIX) == 80
    cached = set(eng.held_block_hashes()["device"])
    solo = {f"r{i}": run(eng, {f"solo{i}": (prompt(i), params(i))})[f"solo{i}"] for i in range(8)}

    calls = poison(eng, monkeypatch)
    batch = {f"r{i}": (prompt(i), params(i)) for i in range(8) if i != 5}
    batch[BAD] = (prompt(5), params(5))
    got = run(eng, batch)
    assert "sampling exploded for one row" in got.pop(BAD)
    assert got == {rid: toks for rid, toks in solo.items() if rid != "r5"}
    # one failed step of 8, its bisection (<= log2(8) + 2 re-runs), then 7 decode steps
    assert calls[0] <= 1 + math.ceil(math.log2(8)) + 2 + 7

    assert_clean(eng)
    assert cached <= set(eng.held_block_hashes()["device"]), "the prefix cache was reset"
    assert eng.num_pinned_blocks() == 5
    monkeypatch.undo()
    out = llm.generate([[*PREFIX, 3]], SamplingParams(max_tokens=1))[0]
    assert out.num_cached_tokens == 80
    assert_clean(eng)


def test_a_reader_of_the_bad_requests_fresh_blocks_is_recomputed(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The good request adopts, in the same step, blocks the bad one computes (a prefix
    hit on blocks registered when scheduled): it is requeued and recomputes them."""
    eng = llm.engine
    shared = [(11 * j) % 300 + 10 for j in range(48)]  # 3 blocks, not cached yet
    good_ids, bad_ids = [*shared, 1, 2, 3], [*shared, 4, 5]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    solo = run(eng, {"solo": (good_ids, sp)})["solo"]
    eng.reset_prefix_cache()

    poison(eng, monkeypatch)
    got = run(eng, {BAD: (bad_ids, sp), "good": (good_ids, sp), "other": (prompt(2), sp)})
    assert isinstance(got[BAD], str) and "exploded" in got[BAD]
    assert got["good"] == solo
    assert eng.scheduler.num_preemptions_total == 1  # "good" was requeued once
    assert_clean(eng)
    # the bad request's blocks were dropped from the cache: a new reader recomputes them
    monkeypatch.undo()
    assert llm.generate([good_ids], sp)[0].outputs[0].token_ids == solo
    assert_clean(eng)


def test_a_step_that_fails_for_everyone_keeps_the_cache(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No single culprit (every run raises): the step's requests fail as before, but only
    the blocks they wrote leave the prefix cache; the pin and older entries stay."""
    eng = llm.engine
    llm.generate([PREFIX], SamplingParams(max_tokens=1))
    llm.pin_prefix(PREFIX)
    cached = set(eng.held_block_hashes()["device"])

    def broken(out: Any) -> Any:
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(eng.runner, "execute", broken)
    sp = SamplingParams(max_tokens=4)
    got = run(eng, {f"r{i}": (PREFIX + prompt(i), sp) for i in range(4)})
    assert all(isinstance(v, str) and "kernel bug" in v for v in got.values()) and len(got) == 4
    assert_clean(eng)
    assert set(eng.held_block_hashes()["device"]) == cached
    assert eng.num_pinned_blocks() == 5
