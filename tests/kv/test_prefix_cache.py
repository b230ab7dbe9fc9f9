"""Prefix caches (hash chain, radix tree), pins, events and the pre-paging allocator, no model."""

from __future__ import annotations

import random

import pytest

from kvstack.config.engine import CacheConfig, SchedulerConfig
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.request import Request, RequestStatus, SamplingParams
from kvstack.kv.contiguous import ContiguousKVManager
from kvstack.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstack.kv.hashing import hash_blocks, root_hash
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.radix import RadixPrefixCache
from kvstack.sched.scheduler import Scheduler

BS = 4
CACHES = ["hash", "radix"]
POLICIES = ["lru", "lfu", "adaptive"]


def req(rid: str, tokens: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid, list(tokens), sp, cache_salt=salt)


def admit(kv: KVCacheManager, r: Request) -> int:
    """Admit ``r`` with its whole prompt as the scheduler would; returns cached tokens."""
    computed = kv.get_computed_blocks(r)
    cached = len(computed) * kv.block_size
    assert kv.allocate_slots(r, r.num_tokens - cached, computed) is not None
    r.num_computed_tokens = r.num_tokens
    kv.check_integrity()
    return cached


@pytest.mark.parametrize("cache", CACHES)
def test_reuse_partial_match_and_last_token(cache: str) -> None:
    kv = KVCacheManager(16, BS, prefix_cache=cache)
    a = req("a", list(range(10)))  # blocks [0-3][4-7] full, [8 9] partial
    assert admit(kv, a) == 0
    kv.free(a)
    kv.check_integrity()
    b = req("b", [*list(range(8)), 99, 98])  # same two full blocks
    assert admit(kv, b) == 8
    c = req("c", list(range(6)) + [77] * 4)  # diverges inside block 1
    assert admit(kv, c) == 4
    d = req("d", list(range(8)))  # exactly two blocks: the last token is recomputed
    assert admit(kv, d) == 4
    e = req("e", list(range(8)), salt="tenant-2")  # another salt shares nothing
    assert admit(kv, e) == 0
    for r in (b, c, d, e):
        kv.free(r)
    kv.check_integrity()
    s = kv.stats()
    assert s.prefix_hit_tokens == 16 and s.prefix_query_tokens == 10 + 10 + 10 + 8 + 8


@pytest.mark.parametrize("cache", CACHES)
def test_shared_blocks_are_ref_counted_and_freed_tail_first(cache: str) -> None:
    kv = KVCacheManager(8, BS, prefix_cache=cache)
    a = req("a", [*list(range(12)), 1])
    admit(kv, a)
    b = req("b", [*list(range(12)), 2])
    assert admit(kv, b) == 12
    shared = kv.req_blocks["a"][:3]
    assert kv.req_blocks["b"][:3] == shared and all(x.ref_cnt == 2 for x in shared)
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.num_free_blocks == 8  # cached blocks count as available
    # x needs 6 blocks; 5 are plain free, so one cached block goes: the chain's tail.
    admit(kv, req("x", [50 + i for i in range(24)]))
    assert len(kv.get_computed_blocks(req("y", [*list(range(12)), 3]))) == 2


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize(("policy", "survivor"), [("lru", "cold"), ("lfu", "hot")])
def test_eviction_order_lru_vs_lfu(cache: str, policy: str, survivor: str) -> None:
    """Hot is hit often but released before cold: LRU drops hot, LFU drops cold."""
    kv = KVCacheManager(6, BS, prefix_cache=cache, eviction_policy=policy)
    prompts = {"hot": [1] * BS + [2], "cold": [3] * BS + [4]}
    for i in range(4):
        admit(kv, r := req(f"hot{i}", prompts["hot"]))
        kv.free(r)
    admit(kv, r := req("cold", prompts["cold"]))
    kv.free(r)
    admit(kv, req("big", [9] * (5 * BS)))  # 4 plain free blocks: one cached must go
    kv.check_integrity()
    alive = {k for k, toks in prompts.items() if kv.get_computed_blocks(req("p", toks))}
    assert alive == {survivor}


@pytest.mark.parametrize("cache", CACHES)
def test_lru_evicts_least_recently_released(cache: str) -> None:
    kv = KVCacheManager(5, BS, prefix_cache=cache, eviction_policy="lru")
    first, second = [1] * BS + [0], [2] * BS + [0]
    for rid, toks in (("1", first), ("2", second)):
        admit(kv, r := req(rid, toks))
        kv.free(r)
    admit(kv, big := req("big", [9] * (3 * BS + 1)))  # 4 blocks: one cached must go
    assert kv.get_computed_blocks(req("p1", first)) == []
    assert len(kv.get_computed_blocks(req("p2", second))) == 1
    kv.free(big)
    kv.check_integrity()


def test_radix_splits_on_partial_match() -> None:
    kv = KVCacheManager(32, BS, prefix_cache="radix")
    cache = kv.cache
    assert isinstance(cache, RadixPrefixCache)
    a = req("a", [*list(range(16)), 1])  # 4 full blocks in one node
    admit(kv, a)
    root = cache.roots[root_hash("", None)]
    assert len(root.children) == 1 and len(next(iter(root.children.values())).blocks) == 4
    b = req("b", list(range(8)) + [70] * 8 + [1])  # shares 2 of the 4 blocks
    assert admit(kv, b) == 8
    top = next(iter(root.children.values()))
    assert len(top.blocks) == 2 and len(top.children) == 2  # split, then b's branch
    kv.free(a)
    kv.free(b)
    cache.check_integrity()
    # Leaves are peeled from their tails; the shared top node goes last.
    evicted = cache.evict(4)
    assert all(blk not in top.blocks for blk in evicted)
    kv.pool.reclaim(evicted)
    kv.check_integrity()


@pytest.mark.parametrize("cache", CACHES)
def test_pins_survive_pressure_and_are_bounded(cache: str) -> None:
    kv = KVCacheManager(10, BS, prefix_cache=cache, max_pinned_fraction=0.5)
    system = list(range(100, 100 + 3 * BS))
    with pytest.raises(InvalidRequestError, match="cached"):
        kv.pin_prefix(system)  # not computed yet
    admit(kv, r := req("sys", [*system, 1]))
    kv.free(r)
    assert kv.pin_prefix(system) == 3 * BS
    assert kv.pin_prefix(system) == 3 * BS  # idempotent
    kv.check_integrity()
    assert kv.num_free_blocks == 7
    admit(kv, big := req("big", [9] * (7 * BS)))  # takes every unpinned block
    kv.free(big)
    assert len(kv.get_computed_blocks(req("q", [*system, 5]))) == 3
    with pytest.raises(InvalidRequestError, match="at most 5"):
        kv.pin_prefix(list(range(6 * BS)))  # longer than the pin limit
    with pytest.raises(InvalidRequestError, match="full block"):
        kv.pin_prefix([1, 2])
    other = list(range(300, 300 + 3 * BS))
    admit(kv, r := req("o", [*other, 1]))
    kv.free(r)
    with pytest.raises(InvalidRequestError, match="limit"):
        kv.pin_prefix(other)  # 3 + 3 > 5 blocks
    assert kv.unpin_prefix(system) and not kv.unpin_prefix(system)
    kv.check_integrity()
    assert kv.num_free_blocks == 10


@pytest.mark.parametrize("cache", CACHES)
def test_events_and_reset(cache: str) -> None:
    kv = KVCacheManager(6, BS, prefix_cache=cache)
    toks = [*list(range(2 * BS)), 1]
    admit(kv, a := req("a", toks))
    batch = kv.events.drain().events
    assert len(batch) == 1 and isinstance(batch[0], BlockStored)
    hashes = hash_blocks(toks, BS, root_hash("", None))
    assert batch[0].block_hashes == hashes and batch[0].parent_block_hash is None
    assert batch[0].token_ids == toks[: 2 * BS]
    assert batch[0].to_dict()["block_hashes"] == [h.hex() for h in hashes]
    kv.free(a)
    admit(kv, big := req("big", [7] * (5 * BS)))
    removed = [e for e in kv.events.drain().events if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) >= 1
    kv.free(big)
    kv.reset_prefix_cache()
    assert isinstance(kv.events.drain().events[-1], AllBlocksCleared)
    assert kv.get_computed_blocks(req("p", toks)) == []
    kv.check_integrity()
    assert kv.num_free_blocks == 6


@pytest.mark.parametrize("cache", CACHES)
def test_reset_while_requests_hold_blocks(cache: str) -> None:
    kv = KVCacheManager(8, BS, prefix_cache=cache)
    admit(kv, a := req("a", [*list(range(3 * BS)), 1]))
    kv.reset_prefix_cache()
    kv.check_integrity()
    a.output_token_ids.extend([5] * (BS - 1))  # grow: re-registers its blocks
    assert kv.allocate_slots(a, BS - 1) is not None
    kv.check_integrity()
    kv.free(a)
    kv.check_integrity()


@pytest.mark.parametrize("cache", [*CACHES, "none"])
@pytest.mark.parametrize("policy", POLICIES)
def test_random_scheduling_never_leaks(cache: str, policy: str) -> None:
    """Random shared-prefix traffic with preemption and aborts; integrity after every step."""
    rng = random.Random(f"{cache}-{policy}")
    kv = KVCacheManager(24, BS, prefix_cache=cache, eviction_policy=policy)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24), kv, max_model_len=64
    )
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 13]))] for _ in range(3)]
    if cache != "none":
        admit(kv, pin := req("pin", prefixes[0] + [1]))
        kv.free(pin)
        kv.pin_prefix(prefixes[0])
    n = 0
    for step in range(300):
        if rng.random() < 0.5 and len(sched.requests) < 10:
            toks = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            sched.add_request(req(f"r{n}", toks, max_tokens=rng.randrange(1, 12)))
            n += 1
        out = sched.schedule()
        sched.update_from_output(
            out, {s.request.request_id: rng.randrange(3, 50) for s in out.scheduled if s.samples}
        )
        if sched.requests and rng.random() < 0.05:
            sched.finish_request(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        if cache != "none" and step == 150:
            kv.reset_prefix_cache()
        sched.check_integrity()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        sched.check_integrity()
    if cache != "none":
        assert kv.prefix_hit_tokens > 0
        kv.reset_prefix_cache()
    assert kv.num_free_blocks == 24


def test_contiguous_first_fit_fragmentation_and_waste() -> None:
    kv = ContiguousKVManager(num_blocks=10, block_size=BS, max_model_len=4 * BS)
    rs = [req(f"r{i}", [1] * 5) for i in range(3)]
    for i, r in enumerate(rs[:2]):
        assert kv.allocate_slots(r, 5) == list(range(4 * i, 4 * i + 4))
        r.num_computed_tokens = 5
    assert kv.allocate_slots(rs[2], 5) is None  # 2 free blocks < one 4-block slab
    assert kv.waste_slots(rs[:2]) == 2 * (4 * BS - 5)
    kv.free(rs[0])
    kv.check_integrity()
    assert kv.allocate_slots(rs[2], 5) == [0, 1, 2, 3]  # first fit reuses the hole
    kv.free(rs[1])
    kv.free(rs[2])
    kv.check_integrity()
    assert kv.free_extents == [(0, 10)]
    exact = ContiguousKVManager(10, BS, 4 * BS, variant="contiguous-request")
    r = req("x", [1] * 5, max_tokens=3)
    assert len(exact.allocate_slots(r, 5) or []) == 2  # prompt + max_tokens = 8 slots
    assert not ContiguousKVManager(3, BS, 4 * BS).can_ever_fit(5)


def test_config_rejects_bad_cache_options() -> None:
    for bad in (dict(block_size=12), dict(block_size=0), dict(prefix_cache="lsm"),
                dict(eviction_policy="fifo"), dict(kv_layout="ring"),
                dict(max_pinned_fraction=1.5)):  # fmt: skip
        with pytest.raises(ConfigError):
            CacheConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="lru, lfu, adaptive"):
        KVCacheManager(4, BS, eviction_policy="mru")


def test_event_log_buffer_is_bounded_by_weight() -> None:
    """One long prompt's BlockStored carries all its token ids: the drain buffer is
    bounded by weight (token ids + hashes), not by the number of events."""
    from kvstack.kv.events import BlockStored, KVEventLog, event_weight

    log = KVEventLog(max_buffered=1000)
    seen: list[object] = []
    log.subscribe(seen.append)
    ev = BlockStored([bytes(16)] * 4, None, list(range(64)), 16)
    assert event_weight(ev) == 1 + 4 + 64
    for _ in range(100):
        log.publish(ev)
    assert len(seen) == 100  # subscribers see everything
    kept = log.drain().events
    assert len(kept) == 1000 // 69 and log.num_dropped == 100 - len(kept)
    assert log.drain().events == []
