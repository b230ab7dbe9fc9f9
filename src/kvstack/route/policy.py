"""Routing policies: which replica serves a request.

A policy sees plain ``Replica`` records (health and load, kept by the router) and the
request's token ids, and returns a ``Decision``. The KV-aware policies hash the prompt
into the engine's block chain (``kv_index.BlockHasher``), ask an index how many leading
blocks each healthy replica already caches, and apply one rule:

1. ``best`` = the longest match (ties: least load, then round-robin rotation).
2. *miss*: ``best`` matches nothing, or less than ``min_match_ratio`` of the request's
   blocks → the least loaded replica (ties: round-robin rotation).
3. *balance*: ``load(best) - min_load > balance_abs`` and ``load(best) > balance_rel ·
   max(min_load, 1)`` → the least loaded replica: the cache is worth less than a queue.
4. otherwise *affinity* → ``best``.

Example (``balance_abs=2``, ``balance_rel=1.5``, a 4-block request)::

    request blocks:        h0 h1 h2 h3     (system prompt h0 h1, user turn h2 h3)
    replica A (load 3):    h0 h1 h2        match 3   <- best
    replica B (load 1):    h0              match 1
    replica C (load 0):                    match 0
    3 - 0 > 2 and 3 > 1.5 · max(0, 1)  -> "balance": C
    with load(A) = 2 instead: 2 - 0 > 2 fails  -> "affinity": A

This is SGLang's cache-aware router (``balance_abs_threshold`` /
``balance_rel_threshold``), with one difference that matters: a miss goes by *load*,
never by cache size. sgl-project/sglang#14305 ("death spiral") sent every miss to the
worker with the smallest radix tree, which is the one busy with unique heavy requests,
so 100 % of new traffic piled onto it while a peer sat idle; sglang#32983 saw a fixed
tie-break pick replica 0 for every miss at low concurrency. Here a miss goes to the least
loaded replica and equal loads rotate, so consecutive misses alternate by construction.

Where the matches come from:

* ``prefix``: approximate, like the Gateway API Inference Extension's prefix-cache scorer
  and Ray Serve's ``PrefixCacheAffinityRouter``: a router-side LRU of the block hashes the
  router itself sent to each replica (``ApproxPrefixIndex``).
* ``kv_events``: precise, like llm-d's KV-cache indexer fed by vLLM KV events: the
  replicas' own event streams (``EventIndex``); a replica whose stream is stale falls back
  to the approximate index, which keeps being recorded, so degrading is seamless.

Policies are plain bookkeeping, not thread-safe: call them from one event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstack.errors import ConfigError, KvstackError
from kvstack.route.kv_index import ApproxPrefixIndex, BlockHasher, EventIndex


@dataclass
class Replica:
    """One backend as the router sees it. ``inflight`` is the router's own count (sent and
    not finished); ``running`` / ``waiting`` / ``kv_usage`` the replica's last ``/load``."""

    id: str
    healthy: bool = True
    inflight: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0

    @property
    def load(self) -> int:
        """Requests on the replica: the router's count, or the replica's if it knows more
        (other routers, or requests the router already considers finished)."""
        return max(self.inflight, self.running + self.waiting)


@dataclass(frozen=True)
class RouteRequest:
    token_ids: Sequence[int]
    cache_salt: str | None = None


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why: ``reason`` is one of ``round_robin``, ``least_load``,
    ``affinity``, ``miss``, ``balance``. KV-aware policies fill in the chosen replica's
    leading match out of ``total_blocks`` and the request's ``block_hashes``."""

    replica_id: str
    reason: str
    matched_blocks: int = 0
    total_blocks: int = 0
    block_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class BalanceConfig:
    """When cache affinity yields to load (SGLang's cache-aware router thresholds).

    Affinity yields when ``load(best) - min_load > balance_abs`` AND ``load(best) >
    balance_rel * max(min_load, 1)``; a request whose best match is below
    ``min_match_ratio`` of its blocks (or zero) is a miss and goes by load alone.

    ``min_match_ratio`` defaults to 0.5, SGLang's ``cache_threshold``: a request that
    shares only a system prompt with earlier traffic is a miss, so a shared prefix does
    not drag all new sessions onto the first replica that saw it (measured on Ray with 4
    concurrent chats: ratio 0 sent all 12 turns to one replica); a later turn of a
    conversation matches most of its blocks and stays where its history is.
    """

    balance_abs: int = 2
    balance_rel: float = 1.5
    min_match_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.balance_abs < 0:
            raise ConfigError(f"balance_abs must be >= 0, got {self.balance_abs}")
        if not self.balance_rel >= 1.0:
            raise ConfigError(f"balance_rel must be >= 1, got {self.balance_rel}")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ConfigError(f"min_match_ratio must be in [0, 1], got {self.min_match_ratio}")


class NoReplicaError(KvstackError):
    """No healthy replica to route to."""


class RoutingPolicy(abc.ABC):
    """Chooses a replica per request among the healthy ones.

    ``choose`` never mutates the replicas; the router calls ``on_routed`` once it has
    actually sent the request. Equal candidates are broken by one rotation cursor: the
    next id (in sorted order) after the last one a rotation picked, so ties go round.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._cursor: str | None = None

    def choose(self, req: RouteRequest, replicas: Sequence[Replica]) -> Decision:
        """The decision for ``req``; ``NoReplicaError`` if no replica is healthy."""
        healthy = sorted((r for r in replicas if r.healthy), key=lambda r: r.id)
        if not healthy:
            raise NoReplicaError(f"no healthy replica among {len(replicas)} to route to")
        return self._choose(req, healthy)

    @abc.abstractmethod
    def _choose(self, req: RouteRequest, healthy: list[Replica]) -> Decision:
        """The decision among ``healthy`` (non-empty, sorted by id)."""

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        """The request was sent as decided. Policies without state learn nothing from it."""
        del req, decision

    def remove_replica(self, replica_id: str) -> None:
        """Forget what the policy knows about a replica that left the pool."""
        if self._cursor == replica_id:
            self._cursor = None

    def check_integrity(self) -> None:
        assert self._cursor is None or isinstance(self._cursor, str)

    def _rotate(self, candidates: list[Replica]) -> Replica:
        """The first candidate (sorted by id) after the cursor, cyclically; moves the cursor."""
        chosen = candidates[0]
        if self._cursor is not None:
            chosen = next((r for r in candidates if r.id > self._cursor), chosen)
        self._cursor = chosen.id
        return chosen

    def _least_loaded(self, healthy: list[Replica]) -> Replica:
        low = min(r.load for r in healthy)
        return self._rotate([r for r in healthy if r.load == low])


class RoundRobinPolicy(RoutingPolicy):
    """Cycles over the healthy replicas in a stable order of ids, skipping unhealthy ones."""

    name = "round_robin"

    def _choose(self, req: RouteRequest, healthy: list[Replica]) -> Decision:
        return Decision(self._rotate(healthy).id, "round_robin")


class LeastLoadPolicy(RoutingPolicy):
    """The replica with the fewest requests (``Replica.load``); ties go round-robin."""

    name = "least_load"

    def _choose(self, req: RouteRequest, healthy: list[Replica]) -> Decision:
        return Decision(self._least_loaded(healthy).id, "least_load")


class PrefixPolicy(RoutingPolicy):
    """Cache affinity on the approximate index of hashes the router sent (Gateway API
    Inference Extension prefix scorer, Ray Serve ``PrefixCacheAffinityRouter``), guarded
    by ``BalanceConfig``. ``on_routed`` records the request's hashes for the chosen replica.
    """

    name = "prefix"

    def __init__(
        self,
        hasher: BlockHasher,
        balance: BalanceConfig | None = None,
        capacity_blocks: int = 65536,
    ) -> None:
        super().__init__()
        self.hasher = hasher
        self.balance = balance if balance is not None else BalanceConfig()
        self.approx = ApproxPrefixIndex(capacity_blocks)

    def match(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """Leading ``hashes`` the replica is believed to cache."""
        return self.approx.match(replica_id, hashes)

    def _choose(self, req: RouteRequest, healthy: list[Replica]) -> Decision:
        hashes = tuple(self.hasher.hashes(req.token_ids, req.cache_salt))
        total = len(hashes)
        matches = {r.id: self.match(r.id, hashes) for r in healthy} if total else {}
        best_len = max(matches.values(), default=0)
        cfg = self.balance

        def decide(replica: Replica, reason: str) -> Decision:
            return Decision(replica.id, reason, matches.get(replica.id, 0), total, hashes)

        if best_len == 0 or best_len < cfg.min_match_ratio * total:
            return decide(self._least_loaded(healthy), "miss")
        longest = [r for r in healthy if matches[r.id] == best_len]
        best = self._least_loaded(longest)
        min_load = min(r.load for r in healthy)
        if best.load - min_load > cfg.balance_abs and best.load > cfg.balance_rel * max(
            min_load, 1
        ):
            return decide(self._least_loaded(healthy), "balance")
        return decide(best, "affinity")

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        self.approx.record(decision.replica_id, decision.block_hashes)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.approx.remove_replica(replica_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.approx.check_integrity()


class KVEventsPolicy(PrefixPolicy):
    """Cache affinity on the replicas' own KV events (llm-d's KV-cache indexer): matches
    come from ``index`` for fresh replicas and from the approximate index (still recorded
    by ``on_routed``) for stale ones. The router feeds ``index.apply`` from each replica's
    ``GET /v1/kv_events`` stream and calls ``index.mark_stale`` when a stream drops."""

    name = "kv_events"

    def __init__(
        self,
        hasher: BlockHasher,
        balance: BalanceConfig | None = None,
        capacity_blocks: int = 65536,
        recent_blocks: int = 256,
    ) -> None:
        super().__init__(hasher, balance, capacity_blocks)
        self.index = EventIndex()
        # Events trail the routing by a step plus the stream's poll interval: a burst of
        # requests with one new prefix would all be misses (and spread) before the first
        # replica announces the blocks. The last ``recent_blocks`` hashes routed to a
        # replica count as held there too, so a burst follows its first request.
        self.recent = ApproxPrefixIndex(recent_blocks)

    def match(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        if self.index.is_fresh(replica_id):
            exact = self.index.match(replica_id, hashes)
            return max(exact, self.recent.match(replica_id, hashes))
        return self.approx.match(replica_id, hashes)

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        super().on_routed(req, decision)
        self.recent.record(decision.replica_id, decision.block_hashes)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.index.remove_replica(replica_id)
        self.recent.remove_replica(replica_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.index.check_integrity()
        self.recent.check_integrity()


POLICIES: tuple[str, ...] = ("round_robin", "least_load", "prefix", "kv_events")


def make_policy(
    name: str,
    *,
    block_size: int = 16,
    model_id: str = "",
    balance: BalanceConfig | None = None,
    capacity_blocks: int = 65536,
) -> RoutingPolicy:
    """The policy called ``name``; ``ConfigError`` naming the valid choices if unknown.

    ``block_size`` and ``model_id`` must be the replicas' (their ``/load``), or the
    KV-aware policies never match anything.
    """
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    if name not in ("prefix", "kv_events"):
        raise ConfigError(f"unknown routing policy {name!r}; choose one of: {', '.join(POLICIES)}")
    hasher = BlockHasher(block_size, model_id)
    if name == "prefix":
        return PrefixPolicy(hasher, balance, capacity_blocks)
    return KVEventsPolicy(hasher, balance, capacity_blocks)
