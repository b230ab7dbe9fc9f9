"""Routing policies: which replica serves a request (pure bookkeeping, no network).

* ``base``: ``Replica`` / ``RouteRequest`` / ``Decision`` records, ``BalanceConfig`` and
  the ``RoutingPolicy`` base class;
* ``load``: ``round_robin``, ``least_load``;
* ``prefix``: the KV-aware ``prefix`` and ``kv_events`` policies and their rule;
* ``kv_index``: the block-hash indexes the KV-aware policies match against;
* ``vllm_events`` / ``vllm_index``: vLLM's ZMQ ``KVEventBatch`` decoded, and the index
  of it keyed by vLLM's block hashes;
* ``prompt``: the token ids a replica will see for an OpenAI body (router-side tokenizing).

Every policy is registered by name in ``ROUTING_POLICIES`` (``kvstack router --policy``,
the Ray Serve router and the Kubernetes manifests list ``ROUTING_POLICIES.names()``);
``make_policy`` builds one. Importing this package imports nothing heavy (``prompt``,
which needs pydantic, is imported only by its users).
"""

from __future__ import annotations

from kvstack.core.registry import Registry
from kvstack.route.policy.base import (
    BalanceConfig,
    Decision,
    NoReplicaError,
    Replica,
    RouteRequest,
    RoutingPolicy,
)
from kvstack.route.policy.load import LeastLoadPolicy, RoundRobinPolicy
from kvstack.route.policy.prefix import KVEventsPolicy, PrefixPolicy

ROUTING_POLICIES: Registry[type[RoutingPolicy]] = Registry("routing policy")
ROUTING_POLICIES.add(RoundRobinPolicy.name, RoundRobinPolicy, "cycle over the healthy replicas")
ROUTING_POLICIES.add(LeastLoadPolicy.name, LeastLoadPolicy, "the replica with the fewest requests")
ROUTING_POLICIES.add(PrefixPolicy.name, PrefixPolicy, "cache affinity on what the router sent")
ROUTING_POLICIES.add(
    KVEventsPolicy.name, KVEventsPolicy, "cache affinity on each replica's KV event stream"
)


def make_policy(
    name: str,
    *,
    block_size: int = 16,
    model_id: str = "",
    balance: BalanceConfig | None = None,
    capacity_blocks: int = 65536,
    hash_algo: str = "sha256",
) -> RoutingPolicy:
    """The policy registered as ``name``; ``ConfigError`` naming the valid choices if none.

    ``block_size`` and ``model_id`` must be the replicas' (their ``/load``), or the
    KV-aware policies never match anything; ``hash_algo`` is the ZMQ publishers'
    ``--prefix-caching-hash-algo`` (``kv_events`` only).
    """
    return ROUTING_POLICIES.get(name).create(
        block_size=block_size, model_id=model_id, balance=balance,
        capacity_blocks=capacity_blocks, hash_algo=hash_algo,
    )  # fmt: skip


__all__ = [
    "ROUTING_POLICIES",
    "BalanceConfig",
    "Decision",
    "KVEventsPolicy",
    "LeastLoadPolicy",
    "NoReplicaError",
    "PrefixPolicy",
    "Replica",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingPolicy",
    "make_policy",
]
