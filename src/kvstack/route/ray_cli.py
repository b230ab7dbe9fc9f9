"""``kvstack serve --ray --replicas N``: the engine as a Ray Serve deployment.

Locally this starts a Ray instance of its own; ``--ray-address auto`` joins a running
cluster instead (``ray start --head`` on one node and ``ray start --address ...`` on the
others, or a KubeRay ``RayCluster``/``RayService``): the same deployment then places its
replicas on any node with free CPUs, and each replica serves its event stream on its
node's address (``--replica-host 0.0.0.0``). Ray owns placement, scaling and restarts;
kvstack's routing policy only picks the replica (``route/ray_serve.py``).

Imports of Ray stay inside the functions: ``kvstack --help`` must not pay for them.
"""

from __future__ import annotations

import argparse
import copy
import logging
import signal
import threading
from typing import Any

from kvstack.errors import ConfigError

logger = logging.getLogger("kvstack.route.ray")


def add_ray_args(p: argparse.ArgumentParser) -> None:
    from kvstack.route.policy import POLICIES

    g = p.add_argument_group("Ray Serve (replicas behind kvstack's routing policy)")
    g.add_argument(
        "--ray",
        action="store_true",
        help="serve N engine replicas as a Ray Serve deployment whose request router is "
        "kvstack's --policy; the OpenAI API is on --host:--port as usual",
    )
    g.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    g.add_argument(
        "--replica-cpus",
        type=float,
        default=0.5,
        help="Ray CPUs reserved per replica, fractional allowed (default 0.5: two replicas "
        "fit a 2-core machine); torch threads per replica = max(1, floor of this)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join ('auto' = the one `ray start` runs here); "
        "default: start a local Ray instance",
    )
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default="kv_events",
        help="routing policy of the deployment (default kv_events: each replica's KV "
        "event stream; prefix: router-side approximate index; least_load; round_robin)",
    )
    g.add_argument(
        "--replica-host",
        default="127.0.0.1",
        help="address each replica's own server binds (its event stream and metrics); "
        "0.0.0.0 on a multi-node cluster, advertised as the node's IP",
    )


def build_ray_app(a: argparse.Namespace) -> Any:
    """The bound Ray Serve application (ingress → engine deployment with our router)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvstack.route.ray_serve import EngineReplica, Ingress, KVRequestRouter

    if a.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {a.replicas}")
    if not a.replica_cpus > 0:
        raise ConfigError(f"--replica-cpus must be positive, got {a.replica_cpus}")
    replica_args = copy.copy(a)
    replica_args.ray = False
    router_options: dict[str, Any] = {
        "request_router_class": KVRequestRouter,
        "request_router_kwargs": {"policy": a.policy, "api_key": a.api_key},
        "request_routing_stats_period_s": 1.0,  # replicas report running/waiting each second
        "request_routing_stats_timeout_s": 5.0,
    }
    router = RequestRouterConfig(**router_options)
    deployment: Any = serve.deployment  # (its overloads confuse mypy)
    engine = deployment(
        EngineReplica,
        name="kvstack-engine",
        num_replicas=a.replicas,
        ray_actor_options={"num_cpus": a.replica_cpus},
        max_ongoing_requests=max(8, 2 * a.max_num_seqs + a.max_waiting),
        request_router_config=router,
        health_check_period_s=2.0,
        health_check_timeout_s=10.0,
        graceful_shutdown_timeout_s=a.shutdown_grace,
    )
    ingress = deployment(
        Ingress, name="kvstack-ingress", ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=4096,
    )  # fmt: skip
    threads = max(1, int(a.replica_cpus))
    return ingress.bind(engine.bind(replica_args, threads, a.replica_host), a.model)


def serve_on_ray(a: argparse.Namespace) -> int:
    """Deploy, log where it serves, and block until SIGTERM/SIGINT."""
    import ray
    from ray import serve

    app = build_ray_app(a)
    logging.getLogger("kvstack").setLevel(logging.INFO)
    ray.init(address=a.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": a.host, "port": a.port})
        serve.run(app, name="kvstack", route_prefix="/")
        logger.info(
            "kvstack on Ray Serve: %d replicas, policy %s, on http://%s:%d",
            a.replicas, a.policy, a.host, a.port,
        )  # fmt: skip
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        logger.info("stopping the Ray Serve deployment")
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
