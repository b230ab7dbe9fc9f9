"""What every routing policy shares: the replica and request records, the decision, the
load-balance guard and the ``RoutingPolicy`` base class (the registry is the package's).

A policy sees plain ``Replica`` records (health and load, kept by the router) and the
request's token ids, and returns a ``Decision``. Invariants: ``choose`` never mutates
the replicas and only ever picks a healthy one; equal candidates are broken by one
rotation cursor (the next id in sorted order after the last rotation pick), so ties go
round; a policy learns only through ``on_routed``. Policies are plain bookkeeping, not
thread-safe: call them from one event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvstack.core.errors import ConfigError, KvstackError


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
    """What a policy sees of a request: its token ids, salt and, for a chat whose tools,
    documents or marked parts are segments (segment reuse), their ``[start, end)`` token ranges
    and the sink every segment entry is computed after (the tokenizer's BOS)."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    segments: tuple[tuple[Any, ...], ...] = ()  # (start, end[, primer ids])
    sink: tuple[int, ...] = ()


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
    # True: the policy hashes prompts into the engine's block chain, so the router needs
    # the model's tokenizer and the replicas' ``block_size`` / ``model_id``.
    kv_aware: ClassVar[bool] = False

    def __init__(self) -> None:
        self._cursor: str | None = None

    @classmethod
    def create(
        cls, *, block_size: int, model_id: str, balance: BalanceConfig | None,
        capacity_blocks: int, hash_algo: str = "sha256",
    ) -> RoutingPolicy:  # fmt: skip
        """The policy for replicas with these hash parameters (``make_policy``'s options);
        policies that do not hash prompts ignore them."""
        del block_size, model_id, balance, capacity_blocks, hash_algo
        return cls()

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
