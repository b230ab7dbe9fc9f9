"""Pluggable eviction policies for the KV prefix cache.

A prefix cache keeps the KV blocks of finished requests so later requests with the same
prefix can reuse them. When the block pool runs out, the cache asks its policy which
*evictable* cached block to drop. A policy only orders opaque hashable keys (in practice
16-byte block hashes, stable across eviction, so ghost lists can recognise returning
keys); it never touches blocks, and imports nothing from kvstack but ``ConfigError`` and
the registry, so an offline analyzer can replay cache logs through the very same code.
Policies are registered by name in ``EVICTION_POLICIES`` (``--eviction-policy``).

Every key moves through these states::

    not cached --on_insert--> held --on_release--> candidate --on_remove--> not cached
                                 ^                     |
                                 +-----on_acquire------+

plus ``on_hit`` in either cached state and ``on_remove`` of a held key (invalidation).
Any other transition is a caller bug and raises ``KeyError`` before any state changes.

Pinning is not a policy concern: the cache pins a block by holding a reference to it, so
a pinned key is simply never released and never becomes a candidate.
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable
from typing import ClassVar

from kvstack.core.errors import ConfigError
from kvstack.core.registry import Registry


def _require(ok: bool, key: Hashable, problem: str) -> None:
    if not ok:
        raise KeyError(f"eviction policy misuse: key {key!r} {problem}")


class EvictionPolicy(abc.ABC):
    """Orders the eviction candidates of a prefix cache of ``capacity`` blocks.

    * ``on_insert(key)``: newly cached and held; counts as the first access.
    * ``on_hit(key)``: a request reused the cached ``key`` (held or candidate).
    * ``on_release(key)``: the held ``key`` lost its last holder; it becomes a candidate.
    * ``on_acquire(key)``: the candidate ``key`` got a holder again.
    * ``on_remove(key)``: the cached ``key`` (held or candidate) left the cache.
    * ``victim()``: the candidate to evict next, not removed; ``IndexError`` if none.
    * ``clear()``: forget everything, ghosts and adaptive state included.
    * ``len(policy)`` / ``key in policy``: number of candidates / is ``key`` one.
    * ``check_integrity()``: assert the internal invariants.

    Invariant of every policy: the candidates are exactly the keys inserted, then
    released, and neither acquired again since nor removed; ``victim()`` is one of them.
    """

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"eviction policy capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    @abc.abstractmethod
    def on_insert(self, key: Hashable) -> None: ...
    @abc.abstractmethod
    def on_hit(self, key: Hashable) -> None: ...
    @abc.abstractmethod
    def on_release(self, key: Hashable) -> None: ...
    @abc.abstractmethod
    def on_acquire(self, key: Hashable) -> None: ...
    @abc.abstractmethod
    def on_remove(self, key: Hashable) -> None: ...
    @abc.abstractmethod
    def victim(self) -> Hashable: ...
    @abc.abstractmethod
    def clear(self) -> None: ...
    @abc.abstractmethod
    def __len__(self) -> int: ...
    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...
    @abc.abstractmethod
    def check_integrity(self) -> None: ...

    def candidate_order(self) -> list[Hashable]:
        """The candidates, next victim first, for the web view's block map (O(n), or
        O(n log n); called only while someone watches). A policy whose order depends on
        the future (the analyzer's Belady oracle) returns ``[]``: the view then shows its
        candidates as cached without a rank."""
        return []


class LRUPolicy(EvictionPolicy):
    """Least recently released candidate first (vLLM v1 ``FreeKVCacheBlockQueue``).

    As in vLLM v1, the order is that of ``on_release``; hits do not reorder candidates.
    Callers release a request's chain tail-first, so a chain's last block is evicted
    before its first, keeping the shared prefix cached longest. All operations are O(1).
    Invariant: held keys and candidates are disjoint.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._held: set[Hashable] = set()
        self._free: OrderedDict[Hashable, None] = OrderedDict()  # oldest release first

    def on_insert(self, key: Hashable) -> None:
        _require(key not in self._held and key not in self._free, key, "is already cached")
        self._held.add(key)

    def on_hit(self, key: Hashable) -> None:
        _require(key in self._held or key in self._free, key, "is not cached")

    def on_release(self, key: Hashable) -> None:
        _require(key in self._held, key, "is not held")
        self._held.remove(key)
        self._free[key] = None

    def on_acquire(self, key: Hashable) -> None:
        _require(key in self._free, key, "is not a candidate")
        del self._free[key]
        self._held.add(key)

    def candidate_order(self) -> list[Hashable]:
        return list(self._free)

    def on_remove(self, key: Hashable) -> None:
        _require(key in self._held or key in self._free, key, "is not cached")
        self._held.discard(key)
        self._free.pop(key, None)

    def victim(self) -> Hashable:
        if not self._free:
            raise IndexError("no eviction candidates")
        return next(iter(self._free))

    def clear(self) -> None:
        self._held.clear()
        self._free.clear()

    def __len__(self) -> int:
        return len(self._free)

    def __contains__(self, key: object) -> bool:
        return key in self._free

    def check_integrity(self) -> None:
        both = self._held.intersection(self._free)
        assert not both, f"keys both held and candidate: {both!r}"


class LFUPolicy(EvictionPolicy):
    """Least frequently used candidate first, ties by least recently released.

    Classic LFU (in-cache frequency): a key counts 1 at ``on_insert`` and +1 per
    ``on_hit``, and its count is forgotten on ``on_remove``. Candidates sit in a binary
    heap of ``(frequency, release sequence number, key)`` with lazy deletion: an entry is
    live iff its key is a candidate with that sequence number and frequency. The heap is
    rebuilt when dead entries outnumber live ones, so operations cost O(log n) amortized.
    Invariants: candidates are cached keys; each candidate has exactly one live entry.
    """

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._freq: dict[Hashable, int] = {}  # every cached key
        self._cand: dict[Hashable, int] = {}  # candidate -> release sequence number
        self._heap: list[tuple[int, int, Hashable]] = []
        self._seq = itertools.count()

    def _live(self, entry: tuple[int, int, Hashable]) -> bool:
        freq, seq, key = entry
        return self._cand.get(key) == seq and self._freq[key] == freq

    def _push(self, key: Hashable) -> None:
        # (freq, seq) is unique among entries, so keys themselves are never compared.
        heapq.heappush(self._heap, (self._freq[key], self._cand[key], key))
        if len(self._heap) > 2 * len(self._cand) + 16:
            self._heap = [(self._freq[k], seq, k) for k, seq in self._cand.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: Hashable) -> None:
        _require(key not in self._freq, key, "is already cached")
        self._freq[key] = 1

    def on_hit(self, key: Hashable) -> None:
        _require(key in self._freq, key, "is not cached")
        self._freq[key] += 1
        if key in self._cand:
            self._push(key)

    def on_release(self, key: Hashable) -> None:
        _require(key in self._freq and key not in self._cand, key, "is not held")
        self._cand[key] = next(self._seq)
        self._push(key)

    def on_acquire(self, key: Hashable) -> None:
        _require(key in self._cand, key, "is not a candidate")
        del self._cand[key]

    def on_remove(self, key: Hashable) -> None:
        _require(key in self._freq, key, "is not cached")
        del self._freq[key]
        self._cand.pop(key, None)

    def victim(self) -> Hashable:
        heap = self._heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        if not heap:
            raise IndexError("no eviction candidates")
        return heap[0][2]

    def clear(self) -> None:
        self._freq.clear()
        self._cand.clear()
        self._heap.clear()

    def candidate_order(self) -> list[Hashable]:
        return sorted(self._cand, key=lambda k: (self._freq[k], self._cand[k]))

    def frequency(self, key: Hashable) -> int:
        """How often the cached ``key`` was used (insert counts once); 0 if not cached."""
        return self._freq.get(key, 0)

    def __len__(self) -> int:
        return len(self._cand)

    def __contains__(self, key: object) -> bool:
        return key in self._cand

    def check_integrity(self) -> None:
        assert self._cand.keys() <= self._freq.keys(), "candidate that is not cached"
        assert all(f >= 1 for f in self._freq.values()), "frequency below 1"
        live = [e[2] for e in self._heap if self._live(e)]
        assert len(live) == len(self._cand), "candidate count != live heap entries"
        assert set(live) == self._cand.keys(), "live heap entries != candidates"


class AdaptivePolicy(EvictionPolicy):
    """ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
    FAST 2003), adapted to a cache in which only some entries are evictable.

    Cached keys are in T1 (not hit since they entered) or T2 (hit at least once); ghost
    lists B1/B2 remember keys recently removed from T1/T2. A key inserted from B1 grows
    the target size ``p`` of T1 by ``max(1, |B2|/|B1|)``, one from B2 shrinks it by
    ``max(1, |B1|/|B2|)``; both go to T2, other new keys to T1.

    Departures from the paper:

    * held entries cannot be evicted, so REPLACE takes the LRU *candidate* of the chosen
      list (T1 if it has candidates and ``|T1| > p`` or T2 has none, else T2), where
      ``|T1|`` counts held entries too; recency among candidates is release order, and
      a hit refreshes a T2 candidate;
    * the cache, not the policy, decides when to evict, and ``victim`` does not know the
      incoming key, so the paper's ``x in B2 and |T1| == p`` tie rule is dropped;
    * ghosts are bounded by ``|B1| + |B2| <= capacity``; when over, B1's oldest goes if
      ``|T1| + |B1| > capacity`` (the paper's ``|L1| <= c``) or B2 is empty, else B2's.

    Invariants: every cached key is in exactly one of T1/T2, candidates are cached keys
    of their list, ghosts are disjoint from each other and from the cache, and
    ``0 <= p <= capacity``.
    """

    name = "adaptive"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._p = 0.0
        self._list: dict[Hashable, int] = {}  # cached key -> 0 (T1) or 1 (T2)
        self._size = [0, 0]  # |T1|, |T2|, held keys included
        # Candidates of T1 / T2 and ghosts B1 / B2, least recent first.
        self._cand: tuple[OrderedDict[Hashable, None], ...] = (OrderedDict(), OrderedDict())
        self._ghost: tuple[OrderedDict[Hashable, None], ...] = (OrderedDict(), OrderedDict())

    @property
    def p(self) -> float:
        """Adaptive target size of T1, in ``[0, capacity]``."""
        return self._p

    def on_insert(self, key: Hashable) -> None:
        _require(key not in self._list, key, "is already cached")
        b1, b2 = self._ghost
        which = 1
        if key in b1:
            self._p = min(float(self.capacity), self._p + max(1.0, len(b2) / len(b1)))
            del b1[key]
        elif key in b2:
            self._p = max(0.0, self._p - max(1.0, len(b1) / len(b2)))
            del b2[key]
        else:
            which = 0
        self._list[key] = which
        self._size[which] += 1

    def on_hit(self, key: Hashable) -> None:
        _require(key in self._list, key, "is not cached")
        c1, c2 = self._cand
        if self._list[key] == 0:
            self._list[key] = 1
            self._size[0] -= 1
            self._size[1] += 1
            if key in c1:
                del c1[key]
                c2[key] = None
        elif key in c2:
            c2.move_to_end(key)

    def on_release(self, key: Hashable) -> None:
        _require(key in self._list, key, "is not cached")
        cand = self._cand[self._list[key]]
        _require(key not in cand, key, "is not held")
        cand[key] = None

    def on_acquire(self, key: Hashable) -> None:
        _require(key in self, key, "is not a candidate")
        del self._cand[self._list[key]][key]

    def on_remove(self, key: Hashable) -> None:
        _require(key in self._list, key, "is not cached")
        which = self._list.pop(key)
        self._cand[which].pop(key, None)
        self._size[which] -= 1
        self._ghost[which][key] = None
        b1, b2 = self._ghost
        while len(b1) + len(b2) > self.capacity:
            drop = b1 if b1 and (self._size[0] + len(b1) > self.capacity or not b2) else b2
            drop.popitem(last=False)

    def victim(self) -> Hashable:
        c1, c2 = self._cand
        if c1 and (self._size[0] > self._p or not c2):
            return next(iter(c1))
        if c2:
            return next(iter(c2))
        raise IndexError("no eviction candidates")

    def candidate_order(self) -> list[Hashable]:
        """The list ``victim`` takes from now first, each least recent first (exact for
        the next victims until ``p`` or the list sizes change)."""
        c1, c2 = self._cand
        first, second = (c1, c2) if c1 and (self._size[0] > self._p or not c2) else (c2, c1)
        return [*first, *second]

    def clear(self) -> None:
        self._p = 0.0
        self._list.clear()
        self._size = [0, 0]
        for d in (*self._cand, *self._ghost):
            d.clear()

    def __len__(self) -> int:
        return len(self._cand[0]) + len(self._cand[1])

    def __contains__(self, key: object) -> bool:
        return key in self._cand[0] or key in self._cand[1]

    def check_integrity(self) -> None:
        for which in (0, 1):
            n = sum(1 for w in self._list.values() if w == which)
            assert self._size[which] == n, f"T{which + 1} size {self._size[which]} != {n}"
            stray = [k for k in self._cand[which] if self._list.get(k) != which]
            assert not stray, f"T{which + 1} candidates not in T{which + 1}: {stray!r}"
            cached = self._list.keys() & self._ghost[which].keys()
            assert not cached, f"B{which + 1} keys that are cached: {cached!r}"
        b1, b2 = self._ghost
        assert not b1.keys() & b2.keys(), "key in both ghost lists"
        assert len(b1) + len(b2) <= self.capacity, "ghost lists exceed capacity"
        assert 0 <= self._p <= self.capacity, f"p={self._p} out of [0, {self.capacity}]"


EVICTION_POLICIES: Registry[type[EvictionPolicy]] = Registry("eviction policy")
EVICTION_POLICIES.add("lru", LRUPolicy, "least recently used (default)")
EVICTION_POLICIES.add("lfu", LFUPolicy, "least frequently used")
EVICTION_POLICIES.add("adaptive", AdaptivePolicy, "ARC: balances recency and frequency")


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy registered as ``name`` for a cache of ``capacity`` blocks."""
    cls = EVICTION_POLICIES.get(name)
    if capacity < 1:
        raise ConfigError(f"eviction policy capacity must be >= 1, got {capacity}")
    return cls(capacity)
