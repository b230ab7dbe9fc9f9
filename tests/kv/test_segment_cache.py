"""SegmentCache (segment reuse) under the prefix cache's eviction policies, and its KV events.

No model: entries are reserved in a bare ``BlockPool`` and driven through the states the
scheduler moves them through (reserve -> ready -> held by a request -> copied).
"""

from __future__ import annotations

import pytest

from kvstack.kv.block_pool import BlockPool
from kvstack.kv.events import KVEventLog, SegmentRemoved, SegmentStored, event_weight
from kvstack.kv.segments import SegmentCache, SegmentEntry

BS = 4


def _cache(policy: str, num_blocks: int = 12, events: KVEventLog | None = None) -> SegmentCache:
    return SegmentCache(BlockPool(num_blocks), BS, (1,), 1.0, policy, events)


def _ready(cache: SegmentCache, key: bytes, n: int = 7) -> SegmentEntry:
    """Reserve ``key`` (``n`` tokens: 2 blocks with the sink), compute it, nobody holds it."""
    entry = cache.reserve(key, n, list(range(10, 10 + n)))
    assert entry is not None
    cache.mark_ready()
    cache.check_integrity()
    return entry


def _use(cache: SegmentCache, key: bytes, times: int) -> None:
    """``times`` requests find the entry, hold it and copy it."""
    for _ in range(times):
        entry = cache.get(key)
        assert entry is not None
        cache.hold(entry)
        cache.check_integrity()
        cache.unhold(entry)
    cache.check_integrity()


@pytest.mark.parametrize(
    ("policy", "survivor"),
    [("lru", b"b"), ("lfu", b"a"), ("adaptive", b"a")],
)
def test_the_eviction_policy_orders_the_entries(policy: str, survivor: bytes) -> None:
    """Entry ``a`` is used three times, then ``b`` is computed (idle after it): LRU evicts
    ``a`` (idle first), LFU (3 hits) and ARC (``a`` in T2, ``b`` in T1) keep ``a``."""
    cache = _cache(policy)
    _ready(cache, b"a")
    _use(cache, b"a", 3)
    _ready(cache, b"b")
    assert cache.release(2) == 2  # one entry's two blocks
    assert list(cache.entries) == [survivor]
    cache.check_integrity()


def test_held_and_pending_entries_are_never_victims() -> None:
    cache = _cache("lfu", num_blocks=5)
    a = _ready(cache, b"a")
    cache.hold(a)  # an admitted request has not copied it yet
    pending = cache.reserve(b"p", 7)
    assert pending is not None and not pending.ready
    assert cache.release(6) == 0  # nothing idle
    assert cache.reserve(b"c", 7) is None  # no room: nothing changes
    cache.check_integrity()
    cache.unhold(a)
    cache.mark_ready()  # p is computed: both idle now
    assert cache.evictable_blocks() == 4
    assert cache.reserve(b"c", 7) is not None  # evicts one idle entry for room
    assert len(cache.entries) == 2
    cache.check_integrity()


def test_ready_entries_are_announced_and_their_eviction_too() -> None:
    log = KVEventLog()
    cache = _cache("lru", events=log)
    pending = cache.reserve(b"x", 5, [7, 8, 9, 10, 11])
    assert pending is not None
    cache.drop_pending()  # a failed step: never announced, so never removed either
    assert log.drain().events == []
    _ready(cache, b"a", 5)
    events = log.drain().events
    assert events == [SegmentStored(b"a", 5, [10, 11, 12, 13, 14], BS)]
    assert events[0].to_dict()["segment_key"] == b"a".hex()
    assert event_weight(events[0]) == 2 + 5
    _ready(cache, b"b", 5)
    cache.release(1)
    cache.reset()
    gone = [e for e in log.drain().events if isinstance(e, SegmentRemoved)]
    assert gone == [SegmentRemoved([b"a"]), SegmentRemoved([b"b"])]
    assert cache.pool.num_free_blocks == cache.pool.num_blocks
    cache.check_integrity()
