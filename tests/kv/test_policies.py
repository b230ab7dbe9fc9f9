"""Eviction policies of the prefix cache (``kvstack.kv.policies``): pure bookkeeping, no model."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

import pytest

from kvstack.core.errors import ConfigError
from kvstack.kv.policies import (
    EVICTION_POLICIES,
    AdaptivePolicy,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    make_policy,
)

ALL = sorted(EVICTION_POLICIES)


def k(i: int) -> bytes:
    """A 16-byte key, like a real block hash."""
    return i.to_bytes(16, "big")


def cached(policy: EvictionPolicy, *keys: bytes) -> None:
    """Insert and release ``keys`` in order: they become candidates."""
    for key in keys:
        policy.on_insert(key)
        policy.on_release(key)


def drain(policy: EvictionPolicy) -> list[Hashable]:
    """Evict every candidate; the eviction order."""
    order = []
    while len(policy):
        key = policy.victim()
        policy.on_remove(key)
        policy.check_integrity()
        order.append(key)
    return order


# ----------------------------------------------------------------------------- registry


def test_registry_and_make_policy() -> None:
    expected = [("lru", LRUPolicy), ("lfu", LFUPolicy), ("adaptive", AdaptivePolicy)]
    assert list(EVICTION_POLICIES.items()) == expected
    for name, cls in EVICTION_POLICIES.items():
        policy = make_policy(name, 8)
        assert type(policy) is cls and policy.name == name and policy.capacity == 8


def test_make_policy_unknown_name() -> None:
    with pytest.raises(ConfigError, match=r"'foo'.*lru, lfu, adaptive"):
        make_policy("foo", 8)


@pytest.mark.parametrize("name", ALL)
def test_bad_capacity(name: str) -> None:
    with pytest.raises(ValueError):
        EVICTION_POLICIES[name](0)
    with pytest.raises(ConfigError):
        make_policy(name, 0)


# ----------------------------------------------------------------------------- all policies


@pytest.mark.parametrize("name", ALL)
def test_empty_and_held_keys_are_never_victims(name: str) -> None:
    policy = make_policy(name, 4)
    with pytest.raises(IndexError):
        policy.victim()
    policy.on_insert(k(1))
    policy.on_insert(k(2))
    policy.on_hit(k(2))
    assert len(policy) == 0 and k(1) not in policy
    with pytest.raises(IndexError):
        policy.victim()
    policy.on_release(k(1))
    assert len(policy) == 1 and k(1) in policy and k(2) not in policy
    assert policy.victim() == k(1)
    assert policy.victim() == k(1)  # victim() does not remove
    policy.on_remove(k(1))
    with pytest.raises(IndexError):
        policy.victim()
    policy.on_remove(k(2))  # invalidating a held key is allowed
    policy.check_integrity()


@pytest.mark.parametrize("name", ALL)
def test_acquire_removes_candidate(name: str) -> None:
    policy = make_policy(name, 4)
    cached(policy, k(1), k(2))
    policy.on_hit(k(1))
    policy.on_acquire(k(1))
    assert k(1) not in policy and len(policy) == 1
    assert policy.victim() == k(2)
    policy.on_remove(k(2))
    with pytest.raises(IndexError):
        policy.victim()
    policy.on_release(k(1))
    assert policy.victim() == k(1)
    policy.check_integrity()


@pytest.mark.parametrize("name", ALL)
def test_clear(name: str) -> None:
    policy = make_policy(name, 4)
    cached(policy, k(1), k(2))
    policy.on_insert(k(3))
    policy.on_remove(k(1))
    policy.clear()
    policy.check_integrity()
    assert len(policy) == 0 and k(2) not in policy
    with pytest.raises(IndexError):
        policy.victim()
    cached(policy, k(1), k(2), k(3))  # everything forgotten: re-inserting is valid
    assert drain(policy) == [k(1), k(2), k(3)]


MISUSE: list[tuple[str, Callable[[EvictionPolicy], None]]] = [
    ("insert twice", lambda p: p.on_insert(k(1))),
    ("insert candidate", lambda p: p.on_insert(k(2))),
    ("release candidate", lambda p: p.on_release(k(2))),
    ("release unknown", lambda p: p.on_release(k(9))),
    ("acquire held", lambda p: p.on_acquire(k(1))),
    ("acquire unknown", lambda p: p.on_acquire(k(9))),
    ("hit unknown", lambda p: p.on_hit(k(9))),
    ("remove unknown", lambda p: p.on_remove(k(9))),
    ("remove removed", lambda p: p.on_remove(k(3))),
    ("release removed", lambda p: p.on_release(k(3))),
]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize(("what", "misuse"), MISUSE, ids=[m[0] for m in MISUSE])
def test_caller_bugs_raise_without_corrupting(
    name: str, what: str, misuse: Callable[[EvictionPolicy], None]
) -> None:
    policy = make_policy(name, 4)
    policy.on_insert(k(1))  # held
    cached(policy, k(2))  # candidate
    cached(policy, k(3))
    policy.on_remove(k(3))  # gone (a ghost for the adaptive policy)
    with pytest.raises((KeyError, AssertionError)):
        misuse(policy)
    policy.check_integrity()
    assert len(policy) == 1 and k(2) in policy and k(1) not in policy
    assert policy.victim() == k(2)
    policy.on_release(k(1))
    assert len(policy) == 2


# ----------------------------------------------------------------------------- LRU


def test_lru_release_order_and_tail_first_chains() -> None:
    policy = LRUPolicy(16)
    chain_a = [k(1), k(2), k(3)]
    chain_b = [k(1), k(2), k(4)]  # shares the prefix k(1), k(2)
    for key in chain_a:
        policy.on_insert(key)
    policy.on_hit(k(1))
    policy.on_hit(k(2))
    policy.on_insert(k(4))
    for key in reversed(chain_a):  # request A finishes first: its tail k(3) only
        if key not in chain_b:
            policy.on_release(key)
    for key in reversed(chain_b):  # request B finishes: k(4), k(2), k(1)
        policy.on_release(key)
    # Hits of candidates do not reorder them.
    policy.on_hit(k(3))
    assert drain(policy) == [k(3), k(4), k(2), k(1)]


def test_lru_reacquired_key_goes_to_the_back() -> None:
    policy = LRUPolicy(4)
    cached(policy, k(1), k(2), k(3))
    policy.on_acquire(k(1))
    policy.on_release(k(1))
    assert drain(policy) == [k(2), k(3), k(1)]


# ----------------------------------------------------------------------------- LFU


def test_lfu_frequency_then_release_recency() -> None:
    policy = LFUPolicy(8)
    for i in range(1, 6):
        policy.on_insert(k(i))
    for key, hits in ((k(1), 2), (k(2), 0), (k(3), 1), (k(4), 0), (k(5), 1)):
        for _ in range(hits):
            policy.on_hit(key)
    for i in (1, 4, 2, 5, 3):
        policy.on_release(k(i))
    # freq: k1=3, k2=1, k3=2, k4=1, k5=2; ties by release order (k4 before k2, k5 before k3).
    assert drain(policy) == [k(4), k(2), k(5), k(3), k(1)]


def test_lfu_hit_on_candidate_and_forgetting_on_remove() -> None:
    policy = LFUPolicy(8)
    cached(policy, k(1), k(2))
    policy.on_hit(k(1))  # hit just before the cache acquires it: frequency rises now
    assert policy.victim() == k(2)
    policy.on_remove(k(2))
    policy.on_acquire(k(1))
    policy.on_release(k(1))
    cached(policy, k(2))  # re-inserted: starts again at frequency 1
    assert drain(policy) == [k(2), k(1)]


def test_lfu_lazy_heap_stays_bounded() -> None:
    policy = LFUPolicy(8)
    cached(policy, k(1), k(2))
    for _ in range(1000):
        policy.on_acquire(k(1))
        policy.on_hit(k(1))
        policy.on_release(k(1))
        policy.on_hit(k(2))
    assert len(policy._heap) <= 2 * len(policy) + 17
    policy.check_integrity()
    # Both at frequency 1001; k(2) was released earlier.
    assert drain(policy) == [k(2), k(1)]


# ----------------------------------------------------------------------------- adaptive (ARC)


def test_arc_scan_does_not_evict_hot_keys() -> None:
    capacity = 4
    policy = AdaptivePolicy(capacity)
    hot = [k(100), k(101)]
    cached(policy, *hot)
    for key in hot:  # reused: T1 -> T2
        policy.on_hit(key)
        policy.on_acquire(key)
        policy.on_release(key)
    live = set(hot)
    for i in range(50):  # a long scan of keys seen once
        if len(live) == capacity:
            victim = policy.victim()
            policy.on_remove(victim)
            live.discard(victim)
        cached(policy, k(i))
        live.add(k(i))
        policy.check_integrity()
    assert set(hot) <= live
    assert policy.p == 0


def test_arc_lru_would_lose_hot_keys_in_the_same_scan() -> None:
    # Contrast: the same trace under LRU evicts the hot keys.
    policy = LRUPolicy(4)
    cached(policy, k(100), k(101))
    live = {k(100), k(101)}
    for i in range(10):
        if len(live) == 4:
            live.discard(victim := policy.victim())
            policy.on_remove(victim)
        cached(policy, k(i))
        live.add(k(i))
    assert not live & {k(100), k(101)}


def test_arc_ghost_hits_adapt_p() -> None:
    policy = AdaptivePolicy(8)
    cached(policy, k(1), k(2))
    drain(policy)  # B1 = [k1, k2]
    policy.on_insert(k(1))  # B1 hit: p += max(1, 0/2) -> 1; k1 goes to T2
    assert policy.p == 1
    policy.on_release(k(1))
    policy.on_remove(k(1))  # k1 was in T2: now in B2
    policy.on_insert(k(2))  # B1 hit: p += max(1, |B2|/|B1| = 1/1) -> 2
    assert policy.p == 2
    policy.on_release(k(2))
    policy.on_remove(k(2))  # B2 = [k1, k2], B1 = []
    cached(policy, k(3))
    policy.on_remove(k(3))  # B1 = [k3]
    policy.on_insert(k(1))  # B2 hit: p -= max(1, |B1|/|B2| = 1/2) -> 1
    assert policy.p == 1
    policy.on_insert(k(2))  # B2 hit: p -= 1 -> 0
    assert policy.p == 0
    policy.on_insert(k(3))  # B1 hit with B2 empty: p += 1
    assert policy.p == 1
    policy.check_integrity()


def test_arc_ghost_ratio_and_bounds_of_p() -> None:
    policy = AdaptivePolicy(3)
    for i in (1, 2):  # put k1, k2 in B2 via T2
        policy.on_insert(k(i))
        policy.on_hit(k(i))
        policy.on_release(k(i))
        policy.on_remove(k(i))
    cached(policy, k(3))
    policy.on_remove(k(3))  # B1 = [k3], B2 = [k1, k2]
    policy.on_insert(k(3))  # p += max(1, 2/1) = 2
    assert policy.p == 2
    for i in (4, 5):
        cached(policy, k(i))
        policy.on_remove(k(i))
    policy.on_insert(k(4))  # B1 = [k4, k5] (B2 trimmed to keep |B1|+|B2| <= 3): p capped at 3
    assert policy.p == 3
    policy.check_integrity()


def test_arc_victim_prefers_t2_when_t1_within_target() -> None:
    policy = AdaptivePolicy(4)
    cached(policy, k(1), k(2))
    drain(policy)  # B1 = [k1, k2]
    policy.on_insert(k(1))  # p = 1, k1 in T2
    cached(policy, k(3))  # T1 = [k3]
    policy.on_release(k(1))
    assert policy.victim() == k(1)  # |T1| = 1 <= p: evict from T2
    cached(policy, k(4))  # |T1| = 2 > p: evict T1's least recently released
    assert policy.victim() == k(3)
    policy.on_acquire(k(3))
    policy.on_acquire(k(4))
    assert policy.victim() == k(1)  # T1 has no candidates: fall back to T2
    policy.on_acquire(k(1))
    policy.on_release(k(4))
    assert policy.victim() == k(4)  # T2 has no candidates: fall back to T1


def test_arc_hit_moves_to_t2_and_refreshes_recency() -> None:
    policy = AdaptivePolicy(8)
    cached(policy, k(1), k(2), k(3))
    for key in (k(1), k(2)):
        policy.on_hit(key)  # T1 candidates -> T2
    policy.on_hit(k(1))  # refresh k1 within T2: k2 is now T2's LRU
    assert policy.victim() == k(3)  # |T1| = 1 > p = 0
    policy.on_remove(k(3))
    assert drain(policy) == [k(2), k(1)]


def test_arc_ghost_lists_are_bounded() -> None:
    capacity = 5
    policy = AdaptivePolicy(capacity)
    for i in range(40):
        policy.on_insert(k(i))
        if i % 3 == 0:
            policy.on_hit(k(i))  # some go through T2, hence B2
        policy.on_release(k(i))
        policy.on_remove(k(i))
        policy.check_integrity()  # asserts |B1| + |B2| <= capacity
    policy.on_insert(k(0))  # long forgotten: a plain miss, p unchanged
    assert policy.p == 0
    policy.on_insert(k(38))  # recent ghost of B1: p grows
    assert policy.p > 0


def test_arc_clear_forgets_ghosts_and_p() -> None:
    policy = AdaptivePolicy(4)
    cached(policy, k(1), k(2))
    drain(policy)
    policy.on_insert(k(1))
    assert policy.p == 1
    policy.clear()
    assert policy.p == 0
    policy.on_insert(k(2))  # no longer a ghost
    assert policy.p == 0
    policy.check_integrity()


# ----------------------------------------------------------------------------- randomized


@pytest.mark.parametrize("name", ALL)
def test_randomized_against_reference_model(name: str) -> None:
    rng = random.Random(20240611)
    capacity = 12
    policy = make_policy(name, capacity)
    held: set[bytes] = set()
    cand: dict[bytes, int] = {}  # candidate -> release order
    freq: dict[bytes, int] = {}
    clock = 0
    evictions = 0
    p_seen: set[float] = set()
    for _ in range(6000):
        r = rng.random()
        cached_keys = sorted(held | cand.keys())
        if r < 0.22 and len(cached_keys) < capacity:
            key = k(rng.randrange(3 * capacity))
            if key not in freq:
                policy.on_insert(key)
                held.add(key)
                freq[key] = 1
        elif r < 0.40 and cached_keys:
            key = rng.choice(cached_keys)
            policy.on_hit(key)
            freq[key] += 1
            if key in cand and rng.random() < 0.8:
                policy.on_acquire(key)
                del cand[key]
                held.add(key)
        elif r < 0.62 and held:
            # Release a whole "chain" of held keys, tail first.
            for key in sorted(rng.sample(sorted(held), rng.randint(1, len(held))), reverse=True):
                policy.on_release(key)
                held.remove(key)
                cand[key] = clock = clock + 1
        elif r < 0.70 and cand:
            key = rng.choice(sorted(cand))
            policy.on_acquire(key)
            del cand[key]
            held.add(key)
        elif r < 0.92 and cand:
            evicted = policy.victim()
            assert isinstance(evicted, bytes)
            policy.on_remove(evicted)
            del cand[evicted], freq[evicted]
            evictions += 1
        elif r < 0.97 and cached_keys:  # invalidation, held or candidate
            key = rng.choice(cached_keys)
            policy.on_remove(key)
            held.discard(key)
            cand.pop(key, None)
            del freq[key]
        elif r >= 0.999:
            policy.clear()
            held.clear()
            cand.clear()
            freq.clear()
        policy.check_integrity()
        assert len(policy) == len(cand)
        for i in range(3 * capacity):
            assert (k(i) in policy) == (k(i) in cand)
        if not cand:
            with pytest.raises(IndexError):
                policy.victim()
            continue
        if isinstance(policy, AdaptivePolicy):
            p_seen.add(policy.p)
        victim = policy.victim()
        assert victim in cand
        # The web view's order: exactly the candidates, the next victim first.
        order = policy.candidate_order()
        assert order[0] == victim and sorted(order) == sorted(cand), (order, cand)
        if name == "lru":
            assert victim == min(cand, key=cand.__getitem__)
        elif name == "lfu":
            assert victim == min(cand, key=lambda key: (freq[key], cand[key]))
    assert evictions > 300
    assert name != "adaptive" or len(p_seen) > 3  # ghost hits did adapt p
