"""``KVManager.forget_blocks``: a failed step's blocks leave the prefix cache, nothing
else does (``kvstack/step_isolation.py``). No model."""

from __future__ import annotations

import pytest

from kvstack.core.request import Request, SamplingParams
from kvstack.kv.events import BlockRemoved
from kvstack.kv.manager import KVCacheManager

BS = 4


def admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[Request, int]:
    r = Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=4))
    computed = kv.get_computed_blocks(r)
    cached = len(computed) * BS
    assert kv.allocate_slots(r, r.num_tokens - cached, computed) is not None
    r.num_computed_tokens = r.num_tokens
    kv.check_integrity()
    return r, cached


@pytest.mark.parametrize("cache", ["hash", "radix"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "adaptive"])
def test_forget_drops_only_the_failed_steps_blocks(cache: str, policy: str) -> None:
    kv = KVCacheManager(32, BS, prefix_cache=cache, eviction_policy=policy)
    a, _ = admit(kv, "a", list(range(13)))  # blocks a0 a1 a2 cached (+ a partial one)
    assert kv.pin_prefix(list(range(4))) == 4
    kv.free(a)  # a1, a2 evictable; a0 pinned
    before = set(kv.cached_hashes())
    b, hit = admit(kv, "b", [*range(8), *range(50, 59)])  # adopts a0 a1; b2 b3 new
    assert hit == 8
    c, hit = admit(kv, "c", [*range(8), *range(50, 54), *range(60, 65)])  # a0 a1 b2; c3 new
    assert hit == 12
    b_new = kv.get_block_ids("b")[2:4]  # the blocks "b"'s (failed) step wrote
    kv.events.drain()

    kv.forget_blocks(b_new)
    kv.check_integrity()
    removed = [
        h for e in kv.events.drain().events if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert len(removed) >= 2 and before <= set(kv.cached_hashes())  # a's entries stay
    assert kv.num_pinned_blocks == 1
    for r in (b, c):
        kv.free(r)
        kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks - 1
    d, hit = admit(kv, "d", [*range(8), *range(50, 58), 1])
    assert hit == 8, "a forgotten block was reused"
    kv.free(d)
    kv.check_integrity()


def test_forget_of_an_unreferenced_block_returns_it_to_the_free_queue() -> None:
    kv = KVCacheManager(8, BS, prefix_cache="radix")
    a, _ = admit(kv, "a", list(range(9)))
    ids = kv.get_block_ids("a")
    kv.free(a)
    free = kv.pool.free_queue.num_free_blocks
    kv.forget_blocks(ids[:1])  # the head: its whole subtree goes
    kv.check_integrity()
    assert kv.cached_hashes() == [] and kv.pool.free_queue.num_free_blocks == free + 2
