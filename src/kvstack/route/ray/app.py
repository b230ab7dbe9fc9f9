"""Build and run the Ray Serve application: ingress → engine deployment with our router.

Imports of Ray stay inside the functions: ``kvstack --help`` must not pay for them.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from kvstack.config.engine import EngineConfig
from kvstack.route.ray.config import RayOptions
from kvstack.serve.server import ServerOptions

logger = logging.getLogger("kvstack.route.ray")


def build_ray_app(engine: EngineConfig, server: ServerOptions, ray: RayOptions) -> Any:
    """The bound Ray Serve application; each replica gets ``engine`` and ``server``."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvstack.route.ray.ingress import Ingress, IngressLimits
    from kvstack.route.ray.replica import EngineReplica
    from kvstack.route.ray.router import KVRequestRouter

    router_options: dict[str, Any] = {
        "request_router_class": KVRequestRouter,
        "request_router_kwargs": {"policy": ray.policy, "api_key": server.api_key},
        "request_routing_stats_period_s": 1.0,  # replicas report running/waiting each second
        "request_routing_stats_timeout_s": 5.0,
    }
    router = RequestRouterConfig(**router_options)
    deployment: Any = serve.deployment  # (its overloads confuse mypy)
    replicas = deployment(
        EngineReplica,
        name="kvstack-engine",
        num_replicas=ray.replicas,
        ray_actor_options={"num_cpus": ray.replica_cpus},
        max_ongoing_requests=max(8, 2 * engine.scheduler.max_num_seqs + server.max_waiting),
        request_router_config=router,
        health_check_period_s=2.0,
        health_check_timeout_s=10.0,
        graceful_shutdown_timeout_s=server.shutdown_grace,
    )
    ingress = deployment(
        Ingress, name="kvstack-ingress", ray_actor_options={"num_cpus": 0.1},
        max_ongoing_requests=4096,
    )  # fmt: skip
    bound = replicas.bind(engine, server, ray.threads, ray.replica_host)
    limits = IngressLimits(server.api_key, server.max_body_bytes, server.body_timeout)
    return ingress.bind(bound, engine.model, limits)


def serve_on_ray(engine: EngineConfig, server: ServerOptions, ray: RayOptions) -> int:
    """Deploy, log where it serves, and block until SIGTERM/SIGINT."""
    import ray as ray_api
    from ray import serve

    app = build_ray_app(engine, server, ray)
    logging.getLogger("kvstack").setLevel(logging.INFO)
    ray_api.init(address=ray.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(app, name="kvstack", route_prefix="/")
        logger.info(
            "kvstack on Ray Serve: %d replicas, policy %s, on http://%s:%d",
            ray.replicas, ray.policy, server.host, server.port,
        )  # fmt: skip
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        logger.info("stopping the Ray Serve deployment")
        serve.shutdown()
    finally:
        ray_api.shutdown()
    return 0
