"""Soft pins (``KVCacheManager.pin_cached_prefix``): the KV a stored conversation keeps for
its next turn. They hold the longest cached prefix, stay within their share of the pool
(older ones released to make room), are the first KV given back when an allocation runs
short, never count against what a request may ever use, and leave no block behind."""

from __future__ import annotations

import pytest

from kvstack.core.request import Request, SamplingParams
from kvstack.kv.manager import KVCacheManager

BS = 4
CACHES = ["hash", "radix"]


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def run(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Compute ``tokens`` (admit and free: their full blocks stay cached)."""
    r = req(rid, tokens)
    computed = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - len(computed) * BS, computed) is not None
    r.num_computed_tokens = r.num_tokens
    kv.free(r)


@pytest.mark.parametrize("cache", CACHES)
def test_soft_pin_holds_the_cached_part_within_its_share(cache: str) -> None:
    kv = KVCacheManager(20, BS, prefix_cache=cache)
    a = list(range(100, 100 + 3 * BS))
    assert kv.pin_cached_prefix(a, None, 0.5) == 0  # nothing cached yet
    run(kv, "a", [*a, 1])
    # Longer than what is cached: the cached full blocks are pinned.
    assert kv.pin_cached_prefix([*a, 7, 7, 7, 7, 7], None, 0.5) == 3 * BS
    assert kv.pin_cached_prefix(a, None, 0.5) == 3 * BS  # idempotent
    assert kv.num_pinned_blocks == 3 and list(kv.soft_pins) != []
    b = list(range(300, 300 + 3 * BS))
    run(kv, "b", [*b, 1])
    # A share of 0.25 (5 blocks) cannot hold both: the older soft pin is released.
    assert kv.pin_cached_prefix(b, None, 0.25) == 3 * BS
    assert len(kv.soft_pins) == 1 and kv.num_pinned_blocks == 3
    assert kv.pin_cached_prefix(list(range(6 * BS)), None, 0.1) == 0  # over the share
    assert kv.unpin_prefix(b) and not kv.soft_pins
    kv.check_integrity()


@pytest.mark.parametrize("cache", CACHES)
def test_soft_pins_are_released_first_when_the_pool_runs_short(cache: str) -> None:
    kv = KVCacheManager(10, BS, prefix_cache=cache, max_pinned_fraction=0.5)
    hard, soft = list(range(100, 100 + 2 * BS)), list(range(200, 200 + 3 * BS))
    run(kv, "h", [*hard, 1])
    run(kv, "s", [*soft, 1])
    assert kv.pin_prefix(hard) == 2 * BS
    assert kv.pin_cached_prefix(soft, None, 0.5) == 3 * BS
    assert kv.num_free_blocks == 8  # soft-pinned blocks are given back on demand
    # A request needing every block but the hard pin's: admitted, the soft pin released.
    assert kv.can_ever_fit(8 * BS)
    big = req("big", [9] * (8 * BS))
    assert kv.allocate_slots(big, 8 * BS) is not None
    assert not kv.soft_pins and kv.num_soft_pins_released == 1
    assert kv.num_pinned_blocks == 2  # the hard pin stands
    kv.free(big)
    kv.check_integrity()
    # Pinning a softly pinned prefix for good makes it a hard pin.
    run(kv, "s2", [*soft, 1])
    assert kv.pin_cached_prefix(soft, None, 0.5) == 3 * BS
    assert kv.pin_prefix(soft) == 3 * BS and not kv.soft_pins
    kv.reset_prefix_cache()
    assert not kv.pins and not kv.soft_pins
    kv.check_integrity()
