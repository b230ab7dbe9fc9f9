"""``RayOptions``: the ``kvstack serve --ray`` flags, declared once (help, default, choices)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass

from kvstack.core.errors import ConfigError
from kvstack.core.options import check_choices, from_namespace, option

RAY = "Ray Serve (replicas behind kvstack's routing policy)"


def _policies() -> Iterable[str]:
    from kvstack.route.policy import ROUTING_POLICIES

    return ROUTING_POLICIES.names()


@dataclass(frozen=True)
class RayOptions:
    """How the engine runs as a Ray Serve deployment; checked only when ``ray`` is set.

    With ``ray``: at least one replica and a positive CPU reservation per replica.
    """

    ray: bool = option(
        False,
        "serve N engine replicas as a Ray Serve deployment whose request router is "
        "kvstack's --policy; the OpenAI API is on --host:--port as usual",
        group=RAY,
    )
    replicas: int = option(2, "engine replicas (default 2)", group=RAY)
    replica_cpus: float = option(
        0.5,
        "Ray CPUs reserved per replica, fractional allowed (default 0.5: two replicas "
        "fit a 2-core machine); torch threads per replica = max(1, floor of this)",
        group=RAY,
    )
    ray_address: str | None = option(
        None,
        "Ray cluster to join ('auto' = the one `ray start` runs here); "
        "default: start a local Ray instance",
        group=RAY,
    )
    policy: str = option(
        "kv_events",
        "routing policy of the deployment (default kv_events: each replica's KV "
        "event stream; prefix: router-side approximate index; least_load; round_robin)",
        group=RAY, choices=_policies, label="routing policy",
    )  # fmt: skip
    replica_host: str = option(
        "127.0.0.1",
        "address each replica's own server binds (its event stream and metrics); "
        "0.0.0.0 on a multi-node cluster, advertised as the node's IP",
        group=RAY,
    )

    def __post_init__(self) -> None:
        if not self.ray:
            return
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {self.replicas}")
        if not self.replica_cpus > 0:
            raise ConfigError(f"--replica-cpus must be positive, got {self.replica_cpus}")
        check_choices(self)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RayOptions:
        return from_namespace(cls, args)

    @property
    def threads(self) -> int:
        """torch threads per replica: the whole CPUs it reserves, at least one."""
        return max(1, int(self.replica_cpus))
