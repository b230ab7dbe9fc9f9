"""Replay of a request log through the engine's prefix cache, for ``kvstack analyze``.

Replay (per policy and cache size, requests one at a time, in the order ``read_log``
gives them), exactly what the scheduler does at admission::

    computed = kv.get_computed_blocks(req)                      # longest cached prefix
    kv.allocate_slots(req, req.num_tokens - len(computed) * bs, computed)
    req.num_computed_tokens = req.num_tokens                    # prefill done
    kv.free(req)                                                # finished: full blocks stay cached

A request larger than the pool (``allocate_slots`` returns None) counts as a miss.
Hit tokens are ``len(computed) * block_size``. Like the engine, the analyzer never
reuses a prompt's last token: a hit covers at most ``(n - 1) // block_size`` blocks, so
even an infinite cache cannot reach a 100 % token hit rate.

Policies besides the engine's (LRU / LFU / adaptive): ``none`` (no cache: 0 hits) and
``oracle``, Belady's MIN (L. A. Belady, "A study of replacement algorithms for a
virtual-storage computer", IBM Systems Journal 5(2), 1966): evict the cached block whose
next use lies farthest in the future. It is plugged into the same ``KVCacheManager`` as
an ``EvictionPolicy`` that is told the future, and serves as the practical upper bound
for any online policy (with chained prefix blocks it is not provably optimal, but
parents are always needed no later than their children, so it keeps chains intact).

Within vs cross session: a hit block is *within-session* when the first request that
stored its hash in the log (= the first request whose full blocks include it) has the
same session id as the hitting request; otherwise (another session, or no session id)
it is *cross-session*.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from kvstack.core.errors import ConfigError
from kvstack.core.request import Request, SamplingParams
from kvstack.kv.hashing import BlockHash, hash_blocks, root_hash
from kvstack.kv.manager import KVCacheManager
from kvstack.kv.policies import EVICTION_POLICIES, EvictionPolicy
from kvstack.tools.analyze.log import LogRequest

__all__ = [
    "ALL_POLICIES",
    "ENGINE_POLICIES",
    "OraclePolicy",
    "PolicyResult",
    "Prepared",
    "prepare",
    "replay",
]

ENGINE_POLICIES: tuple[str, ...] = EVICTION_POLICIES.names()  # lru, lfu, adaptive
ALL_POLICIES: tuple[str, ...] = (*ENGINE_POLICIES, "oracle", "none")


class OraclePolicy(EvictionPolicy):
    """Belady's MIN (1966): evict the candidate whose next use is farthest in the future.

    ``uses[key]`` is the sorted list of request indices that will *hit* ``key`` (the
    block lies within their first ``(n - 1) // block_size`` blocks); ``advance(t)`` sets
    the clock to request ``t``. A key's next use is its first use ``>= clock``, or
    infinity. Candidates sit in a max-heap of ``(next use, release order)`` with lazy
    deletion; since a next use only changes when the clock passes it, ``advance``
    re-pushes the candidates the previous request needed. Ties evict the earliest
    released key (a chain's tail is released first, and its parent is never needed
    later than it).
    """

    name: ClassVar[str] = "oracle"
    INF: ClassVar[int] = sys.maxsize

    def __init__(
        self,
        capacity: int,
        uses: dict[BlockHash, list[int]],
        needs: Sequence[Sequence[BlockHash]],
    ) -> None:
        super().__init__(capacity)
        self.uses = uses
        self.needs = needs
        self.clock = 0
        self._cached: set[Hashable] = set()
        self._cand: dict[Hashable, int] = {}  # candidate -> release sequence number
        self._heap: list[tuple[int, int, Hashable]] = []
        self._seq = itertools.count()

    def next_use(self, key: Hashable) -> int:
        uses = self.uses.get(key, ())  # type: ignore[call-overload]
        i = bisect.bisect_left(uses, self.clock)
        return uses[i] if i < len(uses) else self.INF

    def _push(self, key: Hashable) -> None:
        heapq.heappush(self._heap, (-self.next_use(key), self._cand[key], key))

    def advance(self, t: int) -> None:
        """Move the clock to request ``t`` (requests are replayed in index order)."""
        old, self.clock = self.clock, t
        for i in range(old, t):
            for key in self.needs[i] if i < len(self.needs) else ():
                if key in self._cand:
                    self._push(key)
        if len(self._heap) > 2 * len(self._cand) + 64:
            self._heap = [(-self.next_use(k), s, k) for k, s in self._cand.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: Hashable) -> None:
        if key in self._cached:
            raise KeyError(f"eviction policy misuse: key {key!r} is already cached")
        self._cached.add(key)

    def on_hit(self, key: Hashable) -> None:
        if key not in self._cached:
            raise KeyError(f"eviction policy misuse: key {key!r} is not cached")

    def on_release(self, key: Hashable) -> None:
        if key not in self._cached or key in self._cand:
            raise KeyError(f"eviction policy misuse: key {key!r} is not held")
        self._cand[key] = next(self._seq)
        self._push(key)

    def on_acquire(self, key: Hashable) -> None:
        if key not in self._cand:
            raise KeyError(f"eviction policy misuse: key {key!r} is not a candidate")
        del self._cand[key]

    def on_remove(self, key: Hashable) -> None:
        if key not in self._cached:
            raise KeyError(f"eviction policy misuse: key {key!r} is not cached")
        self._cached.discard(key)
        self._cand.pop(key, None)

    def victim(self) -> Hashable:
        heap = self._heap
        while heap:
            neg, seq, key = heap[0]
            if self._cand.get(key) == seq and -neg == self.next_use(key):
                return key
            heapq.heappop(heap)
        raise IndexError("no eviction candidates")

    def clear(self) -> None:
        self._cached.clear()
        self._cand.clear()
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._cand)

    def __contains__(self, key: object) -> bool:
        return key in self._cand

    def check_integrity(self) -> None:
        assert self._cand.keys() <= self._cached, "candidate that is not cached"


# ---------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class PolicyResult:
    """Replay of the log through one policy at one cache size."""

    policy: str
    cache_size_tokens: int
    num_blocks: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_requests: int
    within_session_hit_tokens: int
    cross_session_hit_tokens: int
    oversized_requests: int  # larger than the whole pool: counted as misses
    evicted_blocks: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.num_requests if self.num_requests else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_hit_rate"] = round(self.token_hit_rate, 6)
        d["request_hit_rate"] = round(self.request_hit_rate, 6)
        d["prefill_tokens_saved"] = self.hit_tokens
        return d


@dataclass
class Prepared:
    """Per-request hashes and facts every replay shares."""

    hashes: list[list[BlockHash]]  # full blocks of each prompt
    needs: list[list[BlockHash]]  # hittable blocks: the first (n - 1) // bs
    uses: dict[BlockHash, list[int]]
    sessions: list[str]  # session key (unique per request when it has none)
    first_storer: dict[BlockHash, str]


def prepare(requests: Sequence[LogRequest], block_size: int) -> Prepared:
    root = root_hash(model_id="", salt=None)  # what KVCacheManager(model_id="") uses
    hashes, needs = [], []
    uses: dict[BlockHash, list[int]] = {}
    sessions: list[str] = []
    first: dict[BlockHash, str] = {}
    for i, r in enumerate(requests):
        hs = hash_blocks(r.token_ids.tolist(), block_size, root)
        need = hs[: (len(r.token_ids) - 1) // block_size]
        hashes.append(hs)
        needs.append(need)
        for h in need:
            uses.setdefault(h, []).append(i)
        sess = f"s:{r.session_id}" if r.session_id is not None else f"r:{i}"
        sessions.append(sess)
        for h in hs:
            first.setdefault(h, sess)
    return Prepared(hashes, needs, uses, sessions, first)


def replay(
    requests: Sequence[LogRequest],
    policy: str,
    cache_size_tokens: int,
    block_size: int = 16,
    prepared: Prepared | None = None,
    on_request: Callable[[], None] | None = None,
) -> PolicyResult:
    """Serve ``requests`` one at a time through a ``KVCacheManager`` (module docstring)."""
    if policy not in ALL_POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose from: {', '.join(ALL_POLICIES)}")
    num_blocks = cache_size_tokens // block_size
    if num_blocks < 1:
        raise ConfigError(
            f"cache size {cache_size_tokens} tokens is smaller than one block ({block_size})"
        )
    prep = prepared if prepared is not None else prepare(requests, block_size)
    prompt_tokens = sum(len(r.token_ids) for r in requests)
    if policy == "none":
        if on_request is not None:
            for _ in requests:
                on_request()
        return PolicyResult(
            policy, cache_size_tokens, num_blocks, len(requests), prompt_tokens, 0, 0, 0, 0, 0, 0
        )
    engine_policy = policy if policy in ENGINE_POLICIES else "lru"
    oracle: OraclePolicy | None = None
    if policy == "oracle":
        oracle = OraclePolicy(num_blocks, prep.uses, prep.needs)
    kv = KVCacheManager(
        num_blocks,
        block_size,
        prefix_cache="hash",
        eviction_policy=engine_policy,
        model_id="",
        policy=oracle,
    )
    hit_tokens = hit_requests = within = oversized = 0
    sp = SamplingParams(max_tokens=1)
    for i, r in enumerate(requests):
        if oracle is not None:
            oracle.advance(i)
        req = Request(f"a{i}", r.token_ids.tolist(), sp)
        computed = kv.get_computed_blocks(req)
        if oracle is not None and kv.block_hashes(req) != prep.hashes[i]:
            raise AssertionError("oracle hashes differ from the KV manager's block hashes")
        if kv.allocate_slots(req, req.num_tokens - len(computed) * block_size, computed) is None:
            oversized += 1
        else:
            req.num_computed_tokens = req.num_tokens
            kv.free(req)
            if computed:
                hit_requests += 1
                hit_tokens += len(computed) * block_size
                sess = prep.sessions[i]
                within += block_size * sum(
                    1 for h in prep.hashes[i][: len(computed)] if prep.first_storer[h] == sess
                )
        if on_request is not None:
            on_request()
    assert kv.prefix_hit_tokens == hit_tokens
    return PolicyResult(
        policy,
        cache_size_tokens,
        num_blocks,
        len(requests),
        prompt_tokens,
        hit_tokens,
        hit_requests,
        within,
        hit_tokens - within,
        oversized,
        kv.stats().num_evicted_blocks,
    )
