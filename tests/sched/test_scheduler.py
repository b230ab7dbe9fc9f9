"""Bookkeeping tested alone, with no model: block pool, KV manager, scheduler."""

from __future__ import annotations

import random

import pytest

from kvstack.config.engine import SchedulerConfig
from kvstack.core.errors import InvalidRequestError
from kvstack.core.request import Request, RequestStatus, SamplingParams
from kvstack.kv.block_pool import BlockPool
from kvstack.kv.manager import KVCacheManager
from kvstack.sched.scheduler import Scheduler

EOS = 2


def make_req(rid: str, n_prompt: int, max_tokens: int = 8, **kw: object) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Request(rid, list(range(10, 10 + n_prompt)), sp, eos_token_ids=frozenset({EOS}))


def test_block_pool_lru_and_integrity() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    pool.check_integrity()
    b = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.allocate(1)
    pool.free(reversed(a))  # tail first: block 1 then block 0
    pool.check_integrity()
    assert [blk.block_id for blk in pool.allocate(2)] == [1, 0]
    pool.free(b)
    with pytest.raises(AssertionError):
        pool.free(b)  # double free is caught
    assert pool.num_free_blocks == 2


def test_manager_allocate_grow_free() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    r = make_req("a", 6)
    ids = kv.allocate_slots(r, 6)
    assert ids is not None and len(ids) == 2
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2) == ids  # 8 slots still fit in 2 blocks
    r.num_computed_tokens = 8
    grown = kv.allocate_slots(r, 1)
    assert grown is not None and len(grown) == 3 and grown[:2] == ids
    assert kv.allocate_slots(make_req("b", 20), 20) is None  # needs 5, only 2 free
    kv.check_integrity()
    assert "b" not in kv.req_blocks
    kv.free(r)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 5
    kv.check_integrity()


def run_to_completion(sched: Scheduler, vocab_token: int = 7, max_steps: int = 10_000) -> int:
    """Drive the scheduler with a fake model that always samples ``vocab_token``."""
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.check_integrity()
        assert out.scheduled, "scheduler made no progress"
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        sampled = {s.request.request_id: vocab_token for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
        sched.check_integrity()
        steps += 1
        assert steps < max_steps
    return steps


def test_chunked_prefill_respects_budget() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), kv, max_model_len=256)
    r = make_req("long", 30, max_tokens=3)
    sched.add_request(r)
    first = sched.schedule()
    assert [s.num_new_tokens for s in first.scheduled] == [8]
    assert not first.scheduled[0].samples
    sched.update_from_output(first, {})
    run_to_completion(sched)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert len(r.output_token_ids) == 3
    assert kv.num_free_blocks == 64


def test_preemption_by_recompute_and_resume() -> None:
    # 6 blocks of 4 slots; three requests of 8 prompt + 8 output tokens need 4 blocks each.
    kv = KVCacheManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=64)
    reqs = [make_req(f"r{i}", 8, max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert sched.num_preemptions_total > 0
    assert any(r.num_preemptions for r in reqs)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [7] * 8
    assert kv.num_free_blocks == 6
    assert not sched.has_unfinished_requests()


def test_rejects_requests_that_can_never_fit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        sched.add_request(make_req("ctx", 40))
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len"):
        sched.add_request(make_req("sum", 20, max_tokens=20))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        sched.add_request(make_req("pool", 16, max_tokens=8))
    ok = make_req("ok", 8, max_tokens=8)
    sched.add_request(ok)
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make_req("ok", 8))
    run_to_completion(sched)
    assert ok.status == RequestStatus.FINISHED_LENGTH


def test_abort_frees_blocks_anywhere() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), kv, max_model_len=64)
    a, b = make_req("a", 8), make_req("b", 8)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, {"a": 5})
    assert sched.num_running == 1 and sched.num_waiting == 1
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    sched.finish_request("missing", RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert kv.num_free_blocks == 16
    assert set(sched.schedule().finished_request_ids) == {"a", "b"}


def test_stop_rules() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64)
    eos = make_req("eos", 4, max_tokens=10)
    ign = make_req("ign", 4, max_tokens=3, ignore_eos=True)
    mint = make_req("min", 4, max_tokens=10, min_tokens=2)
    stop_id = make_req("sid", 4, max_tokens=10, stop_token_ids=[9])
    for r in (eos, ign, mint, stop_id):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {"eos": EOS, "ign": EOS, "min": EOS, "sid": 9})
    assert eos.status == RequestStatus.FINISHED_STOPPED
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 9
    assert ign.status == RequestStatus.RUNNING and mint.status == RequestStatus.RUNNING
    out = sched.schedule()
    sched.update_from_output(out, {"ign": EOS, "min": EOS})
    assert mint.status == RequestStatus.FINISHED_STOPPED
    out = sched.schedule()
    sched.update_from_output(out, {"ign": EOS})
    assert ign.status == RequestStatus.FINISHED_LENGTH
    sched.check_integrity()


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_never_leaks(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=rng.randint(8, 24), block_size=rng.choice([1, 2, 4, 16]))
    cfg = SchedulerConfig(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 48))
    sched = Scheduler(cfg, kv, max_model_len=64)
    reqs = []
    for i in range(20):
        r = make_req(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12))
        try:
            sched.add_request(r)
            reqs.append(r)
        except InvalidRequestError:
            pass
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {s.request.request_id: 7 for s in out.scheduled if s.samples}
        sched.update_from_output(out, sampled)
        if rng.random() < 0.05 and sched.running:
            sched.finish_request(
                rng.choice(sched.running).request_id, RequestStatus.FINISHED_ABORTED
            )
        sched.check_integrity()
        steps += 1
        assert steps < 5000
    assert kv.num_free_blocks == kv.num_blocks
    for r in reqs:
        assert r.is_finished()
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert len(r.output_token_ids) == r.max_tokens
