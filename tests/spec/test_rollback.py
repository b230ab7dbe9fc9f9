"""Draft rows in the scheduler and their rollback, bookkeeping only (no model).

Block size 4, prompt of 6 tokens (``10 .. 15``, positions 0..5); the prefill samples
token 100 (position 6). A 3-token draft then gets rows at positions 6..9 (token 100,
then the drafts), so slots 6..9::

    slots:  [0 1 2 3][4 5 6 7][8 9 . .]     6: token 100, 7 8 9: drafts 101 102 103
"""

from __future__ import annotations

from kvstack.config.engine import SchedulerConfig
from kvstack.core.request import Request, RequestStatus, SamplingParams
from kvstack.kv.manager import KVCacheManager
from kvstack.sched.scheduler import Scheduler


def setup(max_tokens: int = 20, budget: int = 64) -> tuple[Scheduler, KVCacheManager, Request]:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = Request("r", list(range(10, 16)), sp)
    sched.add_request(req)
    while True:  # the prefill (chunked when the budget is small) samples token 100
        out = sched.schedule()
        if out.scheduled[0].samples:
            sched.update_from_output(out, {"r": 100})
            return sched, kv, req
        sched.update_from_output(out, {})


def test_draft_rows_are_scheduled_and_budgeted() -> None:
    sched, kv, req = setup()
    req.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.draft_token_ids) == (6, 4, [101, 102, 103])
    assert s.samples and out.total_num_scheduled_tokens == 4
    assert len(s.block_ids) == 3  # slots 0..9 (6 computed + 4 rows)
    assert req.num_computed_tokens == 7  # the real token only; drafts are not tokens yet
    assert req.all_token_ids[-1] == 100
    kv.check_integrity()


def test_rejected_rows_roll_back_slots_and_blocks() -> None:
    sched, kv, req = setup()
    free_before = kv.num_free_blocks
    req.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    assert kv.num_free_blocks == free_before - 1  # block 2, for draft rows only
    sched.update_from_output(out, {"r": 7}, {"r": []})  # 101 rejected; row 0 gave 7
    assert req.output_token_ids == [100, 7]
    assert req.num_computed_tokens == 7  # positions 0..6 have KV; 7's comes next step
    assert len(kv.get_block_ids("r")) == 2  # block 2 held only rejected rows: freed
    assert kv.num_free_blocks == free_before
    sched.check_integrity()
    # Block 0 (tokens 10..13) is hashed; block 1 (14 15 100 7) once it is computed.
    blocks = kv.req_blocks["r"]
    assert blocks[0].block_hash is not None and blocks[1].block_hash is None
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 1
    assert blocks[1].block_hash == kv.block_hashes(req)[1]  # real tokens, computed now


def test_partial_acceptance_keeps_the_block_of_the_next_token() -> None:
    sched, kv, req = setup()
    req.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    sched.update_from_output(out, {"r": 7}, {"r": [101]})  # 101 kept, 102 rejected -> 7
    assert req.output_token_ids == [100, 101, 7] and req.num_computed_tokens == 8
    assert len(kv.get_block_ids("r")) == 3  # slot 8 (token 7, next step) is in block 2
    sched.check_integrity()


def test_unverified_rows_are_never_hashed() -> None:
    sched, kv, req = setup()
    req.output_token_ids += [100, 100]  # 9 tokens: the next full block would need 12
    req.num_computed_tokens = 8
    req.spec_token_ids = [1, 2, 3, 4, 5]
    sched.schedule()  # rows for positions 8..13: block 2 complete only with drafts
    assert [b.block_hash is not None for b in kv.req_blocks["r"]] == [True, True, False, False]
    assert len(kv.cached_hashes()) == 2


def test_all_accepted_appends_the_bonus_and_keeps_the_blocks() -> None:
    sched, kv, req = setup()
    req.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    sched.update_from_output(out, {"r": 104}, {"r": [101, 102, 103]})
    assert req.output_token_ids == [100, 101, 102, 103, 104]
    assert req.num_computed_tokens == 10 and len(kv.get_block_ids("r")) == 3  # rows 6..9
    sched.check_integrity()


def test_stops_inside_the_run_cut_it_and_free_everything() -> None:
    sched, kv, req = setup(max_tokens=3)
    req.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [101]  # room: max_tokens - 1 out - 1 bonus
    sched, kv, req = setup()
    req.sampling_params.stop_token_ids = [102]
    req.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    sched.update_from_output(out, {"r": 104}, {"r": [101, 102, 103]})
    assert req.output_token_ids == [100, 101, 102] and req.stop_reason == 102
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks == kv.num_blocks
    sched.check_integrity()


def test_budget_and_pool_cut_drafts_and_never_preempt() -> None:
    sched, kv, req = setup(budget=3)
    req.spec_token_ids = [101, 102, 103]
    assert sched.schedule().scheduled[0].draft_token_ids == [101, 102]  # 1 + 2 rows
    sched, kv, req = setup()
    held = kv.allocate_blocks(kv.num_free_blocks)  # the pool is full: block 2 cannot come
    assert held is not None
    req.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [] and out.scheduled[0].num_new_tokens == 1
    assert not out.preempted_request_ids
    kv.release_blocks(held)
    sched.check_integrity()
