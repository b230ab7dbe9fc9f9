"""kvstack on Ray Serve: engine replicas as a deployment, kvstack's policy as its router.

Ray Serve owns placement, scaling, health checks and restarts; kvstack brings only its
choice of replica, through Ray Serve's ``RequestRouter`` API (the extension point of
Ray's own ``PrefixCacheAffinityRouter``)::

    HTTP ─► Ray proxy ─► Ingress (tokenizes) ─handle─► KVRequestRouter.choose_replicas
                                                          │ policy.choose(token ids, loads)
                          ┌───────────────────────────────┴───────────────┐
                          ▼                                               ▼
                 EngineReplica 1                                  EngineReplica 2
                 (kvstack server on a                             (its own loopback port:
                  loopback port: API,                              /v1/kv_events feeds the
                  /v1/kv_events, /metrics)                         router's EventIndex)

``KVRequestRouter`` keeps one ``RoutingPolicy`` per router process; with ``kv_events``
it follows every replica's event stream (``EventFollower``). Its first rank is the
policy's choice, the others (least loaded first) only if that replica's queue is full.
In-flight counts come from Ray's routed/completed callbacks. Replicas: ``replica.py``;
the OpenAI front and its one retry: ``ingress.py``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from kvstack.route.policy import (
    BalanceConfig,
    Decision,
    Replica,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)
from kvstack.route.ray import state
from kvstack.route.router.events_client import EventFollower

logger = logging.getLogger("kvstack.route.ray")
MAX_PENDING_DECISIONS = 4096


class KVRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router that asks a kvstack ``RoutingPolicy`` for each request."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy_name: str = kwargs.get("policy", "kv_events")
        default = BalanceConfig()
        self.balance = BalanceConfig(
            int(kwargs.get("balance_abs", default.balance_abs)),
            float(kwargs.get("balance_rel", default.balance_rel)),
            float(kwargs.get("min_match_ratio", default.min_match_ratio)),
        )
        api_key = kwargs.get("api_key")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.policy: RoutingPolicy | None = None
        self.inflight: dict[str, int] = {}
        self.routed: dict[str, int] = {}  # requests per replica since start
        self.reasons: dict[str, int] = {}
        self._decisions: dict[str, tuple[RouteRequest, Decision]] = {}
        self._req_replica: dict[str, str] = {}
        self._followers: dict[str, EventFollower] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        state.ROUTERS.append(self)

    def _ensure_policy(self, replicas: list[RunningReplica]) -> RoutingPolicy:
        if self.policy is None:
            meta = next((r.replica_metadata for r in replicas if r.replica_metadata), {})
            self.policy = make_policy(
                self.policy_name, block_size=int(meta.get("block_size", 16)),
                model_id=str(meta.get("model_id", "")), balance=self.balance,
            )  # fmt: skip
        return self.policy

    def _follow(self, replicas: list[RunningReplica]) -> None:
        index = getattr(self.policy, "index", None)
        for r in replicas:
            rid, url = r.replica_id.unique_id, r.replica_metadata.get("url")
            self._meta.setdefault(rid, r.replica_metadata)
            if index is not None and url and rid not in self._followers:
                f = EventFollower(rid, url, index, headers=self.headers)
                f.start()
                self._followers[rid] = f

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        policy = self._ensure_policy(candidate_replicas)
        self._follow(candidate_replicas)
        views = []
        for r in candidate_replicas:
            # Load = this router's own in-flight count, exact at every decision. The
            # replicas' running/waiting (routing stats) trail by up to a second; folding
            # them in made affinity yield to phantom imbalance in 32 of 42 multi-turn
            # decisions (measured). With several ingress replicas each router balances
            # its own share, as separate SGLang router instances do.
            rid = r.replica_id.unique_id
            kv_usage = float((r.routing_stats or {}).get("kv_usage", 0.0))
            views.append(Replica(rid, True, self.inflight.get(rid, 0), kv_usage=kv_usage))
        call = pending_request.args[0] if pending_request and pending_request.args else None
        # Duck-typed: Ray ships this class by value, so its ``EngineCall`` may be a copy.
        req = RouteRequest(getattr(call, "token_ids", ()), getattr(call, "cache_salt", None))
        key = pending_request.metadata.internal_request_id if pending_request else None
        if key is not None and key in self._decisions:  # Ray asks again (backoff): same answer
            d = self._decisions[key][1]
        else:
            d = policy.choose(req, views)
            if key is not None:
                # Count the request now, not when Ray reports it routed: Ray chooses for a
                # burst of queued requests before any is sent, and each must see the ones
                # before it (measured: counting late sent 27 of 36 turns to one replica).
                policy.on_routed(req, d)
                self._add_inflight(d.replica_id, 1)
                self._decisions[key] = (req, d)
                while len(self._decisions) > MAX_PENDING_DECISIONS:  # cancelled before routing
                    old_key = next(iter(self._decisions))
                    self._add_inflight(self._decisions.pop(old_key)[1].replica_id, -1)
        load = {v.id: v.load for v in views}
        first = [r for r in candidate_replicas if r.replica_id.unique_id == d.replica_id]
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id.unique_id != d.replica_id),
            key=lambda r: load[r.replica_id.unique_id],
        )
        return [first, rest]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        rid = replica_id.unique_id
        key = pending_request.metadata.internal_request_id
        got = self._decisions.pop(key, None)
        if got is None:  # never chosen by us (no pending request): count it now
            req, d = RouteRequest(()), Decision(rid, "least_load")
            self._add_inflight(rid, 1)
        else:
            req, d = got
        if d.replica_id != rid:  # the chosen replica's queue was full: Ray took the next rank
            self._add_inflight(d.replica_id, -1)
            self._add_inflight(rid, 1)
            d = Decision(rid, "balance", 0, d.total_blocks, d.block_hashes)
            if self.policy is not None:
                self.policy.on_routed(req, d)
        self.routed[rid] = self.routed.get(rid, 0) + 1
        self.reasons[d.reason] = self.reasons.get(d.reason, 0) + 1
        self._req_replica[key] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._req_replica.pop(internal_request_id, replica_id.unique_id)
        self._add_inflight(rid, -1)

    def _add_inflight(self, rid: str, delta: int) -> None:
        self.inflight[rid] = max(0, self.inflight.get(rid, 0) + delta)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        rid = replica_id.unique_id
        if self.policy is not None:
            self.policy.remove_replica(rid)
        follower = self._followers.pop(rid, None)
        if follower is not None:
            task = self._event_loop.create_task(follower.stop())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        logger.warning("replica %s died: removed from routing", rid)

    def state(self) -> dict[str, Any]:
        index = getattr(self.policy, "index", None)
        replicas = []
        for rid in sorted(self._meta):
            fresh = index.is_fresh(rid) if index is not None else None
            replicas.append(
                {"id": rid, **self._meta.get(rid, {}), "inflight": self.inflight.get(rid, 0),
                 "routed": self.routed.get(rid, 0), "events_fresh": fresh}
            )  # fmt: skip
        return {"policy": self.policy_name, "reasons": dict(self.reasons), "replicas": replicas}
