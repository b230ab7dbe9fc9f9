"""Load-only policies: ``round_robin`` and ``least_load`` (no prompt hashing, no state
beyond the rotation cursor)."""

from __future__ import annotations

from kvstack.route.policy.base import Decision, Replica, RouteRequest, RoutingPolicy


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
