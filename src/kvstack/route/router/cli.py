"""``kvstack router``: the KV-aware OpenAI front for replicas on Kubernetes or bare metal.

    kvstack router --backend http://10.0.0.5:8000 --backend http://10.0.0.6:8000
    kvstack router --discover-dns kvstack-engine-headless:8000 --policy kv_events
    kvstack router --backend http://10.0.0.7:8000 \
        --kv-events-endpoint http://10.0.0.7:8000=tcp://10.0.0.7:5557,tcp://10.0.0.7:5558

It picks a replica per request (``route.policy``) and proxies; it never places, scales or
restarts replicas. Bad options raise ``ConfigError`` before anything starts (the CLI prints
one line and exits 2). SIGTERM / SIGINT stop it gracefully: uvicorn stops accepting, lets
in-flight requests finish (up to ``--shutdown-grace``), then the lifespan stops the health
and event loops; a second signal forces the exit.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstack.core.errors import ConfigError
from kvstack.kv.vllm_hashing import HASH_ALGOS, NON_CRYPTO_ALGOS, hash_function
from kvstack.route.policy import ROUTING_POLICIES, BalanceConfig, RoutingPolicy, make_policy
from kvstack.route.router.discovery import (
    MAX_DISCOVERED,
    normalize_url,
    parse_dns_target,
    parse_networks,
)
from kvstack.route.router.event_sources import EventEndpoints

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvstack.route.router.backends import BackendPool

logger = logging.getLogger("kvstack.route")
HEADER_TIMEOUT_S = 10.0  # a client connection must send its request headers within it


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Every ``kvstack router`` option, in three groups."""
    _add_backend_args(p.add_argument_group("backends"))
    _add_routing_args(p.add_argument_group("routing"))
    _add_server_args(p.add_argument_group("router server"))


def _add_backend_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--backend", action="append", default=[], metavar="URL",
        help="a `kvstack serve` replica, http://HOST:PORT (repeat for each replica)",
    )  # fmt: skip
    g.add_argument(
        "--discover-dns", default=None, metavar="HOST:PORT",
        help="also use every A/AAAA record of HOST as a backend on PORT, re-resolved every "
        "--dns-interval seconds (a Kubernetes headless Service)",
    )  # fmt: skip
    g.add_argument(
        "--dns-interval", type=float, default=5.0,
        help="seconds between DNS lookups of --discover-dns (default 5)",
    )  # fmt: skip
    g.add_argument(
        "--discover-allow", action="append", default=[], metavar="CIDR",
        help="let --discover-dns use addresses in this network even if loopback or "
        "link-local (refused by default: the router sends its key to every backend); "
        "repeatable, e.g. 127.0.0.0/8",
    )  # fmt: skip
    g.add_argument(
        "--discover-max", type=int, default=MAX_DISCOVERED,
        help=f"most backends --discover-dns adds (default {MAX_DISCOVERED})",
    )  # fmt: skip
    g.add_argument(
        "--health-interval", type=float, default=2.0,
        help="seconds between GET /health + /load of each backend (default 2)",
    )  # fmt: skip
    g.add_argument(
        "--health-timeout", type=float, default=2.0,
        help="seconds a health or load check may take before it counts as failed (default 2)",
    )  # fmt: skip
    g.add_argument(
        "--fail-threshold", type=int, default=2,
        help="consecutive failed checks or requests that eject a backend; one passing "
        "check readmits it (default 2)",
    )  # fmt: skip


def _add_routing_args(r: argparse._ArgumentGroup) -> None:
    r.add_argument(
        "--policy", choices=ROUTING_POLICIES.names(), default="kv_events",
        help="kv_events: match prompts against each replica's KV event stream (default; "
        "approximate while a stream is down); prefix: against what the router sent; "
        "least_load; round_robin",
    )  # fmt: skip
    r.add_argument(
        "--model", default="default",
        help="model whose tokenizer hashes prompts like the replicas do: 'default' "
        "(SmolLM2-135M-Instruct), a .gguf file or a Hugging Face folder",
    )  # fmt: skip
    bal = BalanceConfig()  # the policy's own defaults, not a second copy of them
    r.add_argument(
        "--balance-abs", type=int, default=bal.balance_abs,
        help="cache affinity yields to load when load(best) - min load exceeds this ... "
        f"(default {bal.balance_abs})",
    )  # fmt: skip
    r.add_argument(
        "--balance-rel", type=float, default=bal.balance_rel,
        help="... and load(best) exceeds this times max(min load, 1) "
        f"(default {bal.balance_rel})",
    )  # fmt: skip
    r.add_argument(
        "--min-match-ratio", type=float, default=bal.min_match_ratio,
        help="a best match below this share of the prompt's blocks is a miss, routed by "
        f"load (default {bal.min_match_ratio}, SGLang's cache_threshold; 0: any match counts)",
    )  # fmt: skip
    r.add_argument(
        "--prefix-capacity-blocks", type=int, default=65536,
        help="block hashes the approximate index remembers per replica (default 65536)",
    )  # fmt: skip
    _add_event_args(r)
    r.add_argument(
        "--prefill-timeout", type=float, default=30.0,
        help="seconds the prefill step of a prefill/decode pair may take before the "
        "decode replica recomputes the prompt (default 30)",
    )  # fmt: skip


def _add_event_args(r: argparse._ArgumentGroup) -> None:
    """Where ``--policy kv_events`` reads each backend's events (``event_sources.py``)."""
    r.add_argument(
        "--kv-events-endpoint", action="append", default=[], metavar="BACKEND=PUB[,REPLAY]",
        help="follow BACKEND's ZMQ KV events (vLLM's KVEventBatch; a vLLM or kvstack "
        "replica started with --kv-events-config) instead of its SSE stream, e.g. "
        "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 (the second "
        "endpoint: its replay socket); repeatable",
    )  # fmt: skip
    r.add_argument(
        "--kv-events-port", default=None, metavar="PORT[,REPLAY_PORT]",
        help="follow every other backend (--discover-dns ones included) over ZMQ at "
        "tcp://<its host>:PORT (and its replay socket at REPLAY_PORT)",
    )  # fmt: skip
    r.add_argument(
        "--kv-events-topic", default="",
        help="ZMQ topic to subscribe to: the publishers' KVEventsConfig topic (default: all)",
    )  # fmt: skip
    r.add_argument(
        "--prefix-caching-hash-algo", choices=HASH_ALGOS, default="sha256",
        help="the ZMQ publishers' --prefix-caching-hash-algo: the router recomputes their "
        "block hashes from each prompt (default sha256, vLLM's); with xxhash set the same "
        "PYTHONHASHSEED as the engines",
    )  # fmt: skip


def _add_server_args(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    s.add_argument(
        "--api-key", default=os.environ.get("KVSTACK_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/*, /router/state and /metrics "
        "(passed on to the backends, and used for their /load and /v1/kv_events); "
        "default $KVSTACK_API_KEY",
    )  # fmt: skip
    s.add_argument(
        "--open-endpoints", choices=("none", "metrics"), default="none",
        help="with --api-key, 'metrics' serves /metrics without the key (it names every "
        "backend and its health; default none: Prometheus sends the key). See SECURITY.md",
    )  # fmt: skip
    s.add_argument(
        "--request-timeout", type=float, default=None,
        help="seconds a backend may take to send its first byte (a non-streaming answer: "
        "all of it) before the request is retried once elsewhere (default: no limit)",
    )  # fmt: skip
    s.add_argument(
        "--idle-timeout", type=float, default=600.0,
        help="seconds a backend's response may stay silent (before its first byte or "
        "mid-stream) before it is cut (default 600)",
    )  # fmt: skip
    s.add_argument(
        "--max-connections", type=int, default=4096,
        help="open client connections past which new requests get 503 (default 4096)",
    )  # fmt: skip
    s.add_argument(
        "--max-body-bytes", type=int, default=8 * 1024 * 1024,
        help="larger request bodies get 413 (default 8 MiB)",
    )  # fmt: skip
    s.add_argument(
        "--shutdown-grace", type=float, default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish (default 30)",
    )  # fmt: skip


@dataclass(frozen=True)
class RouterSettings:
    """Validated options of ``kvstack router``."""

    backends: tuple[str, ...]
    balance: BalanceConfig
    event_endpoints: EventEndpoints = field(default_factory=EventEndpoints)


def validate_router_args(a: argparse.Namespace) -> RouterSettings:
    """Check every option; ``ConfigError`` naming the first bad one."""
    if not a.backend and not a.discover_dns:
        raise ConfigError("give at least one --backend URL or --discover-dns HOST:PORT")
    backends: list[str] = []
    for url in a.backend:
        norm = normalize_url(url)
        if norm in backends:
            raise ConfigError(f"--backend {url} given twice")
        backends.append(norm)
    if a.discover_dns:
        parse_dns_target(a.discover_dns)
    parse_networks(a.discover_allow)
    if a.discover_max < 1:
        raise ConfigError(f"--discover-max must be >= 1, got {a.discover_max}")
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {a.port}")
    positive = {
        "--health-interval": a.health_interval, "--health-timeout": a.health_timeout,
        "--dns-interval": a.dns_interval, "--prefill-timeout": a.prefill_timeout,
        "--idle-timeout": a.idle_timeout, "--max-connections": a.max_connections,
    }  # fmt: skip
    if a.request_timeout is not None:
        positive["--request-timeout"] = a.request_timeout
    for name, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if a.fail_threshold < 1:
        raise ConfigError(f"--fail-threshold must be >= 1, got {a.fail_threshold}")
    if a.max_body_bytes < 1:
        raise ConfigError(f"--max-body-bytes must be >= 1, got {a.max_body_bytes}")
    if a.prefix_capacity_blocks < 1:
        raise ConfigError(f"--prefix-capacity-blocks must be >= 1, got {a.prefix_capacity_blocks}")
    if a.shutdown_grace < 0:
        raise ConfigError(f"--shutdown-grace must be >= 0, got {a.shutdown_grace}")
    try:
        balance = BalanceConfig(a.balance_abs, a.balance_rel, a.min_match_ratio)
    except ConfigError as e:
        msg = str(e).replace("balance_", "--balance-").replace("min_match_", "--min-match-")
        raise ConfigError(msg) from None
    return RouterSettings(tuple(backends), balance, _event_endpoints(a, backends))


def _event_endpoints(a: argparse.Namespace, backends: list[str]) -> EventEndpoints:
    ends = EventEndpoints.parse(a.kv_events_endpoint, a.kv_events_port)
    if ends.any and a.policy != "kv_events":
        raise ConfigError("--kv-events-endpoint / --kv-events-port need --policy kv_events")
    for url in ends.explicit:
        if url not in backends and not a.discover_dns:
            raise ConfigError(f"--kv-events-endpoint: {url} is not a --backend")
    algo = a.prefix_caching_hash_algo
    if ends.any and algo in NON_CRYPTO_ALGOS and "PYTHONHASHSEED" not in os.environ:
        raise ConfigError(
            f"--prefix-caching-hash-algo {algo} seeds every process at random unless "
            "PYTHONHASHSEED is set (vLLM's rule): set the engines' PYTHONHASHSEED here too"
        )
    if ends.any and algo != "builtin":
        hash_function(algo)  # xxhash without its package: now
    return ends


def build_router(a: argparse.Namespace, settings: RouterSettings) -> tuple[BackendPool, FastAPI]:
    """The pool and the FastAPI app for validated options (loads the tokenizer)."""
    from kvstack.route.router.app import RouterConfig, create_router_app
    from kvstack.route.router.backends import BackendPool

    tokenizer = None
    if ROUTING_POLICIES.get(a.policy).kv_aware:
        from kvstack.model.loader.registry import load_tokenizer

        tokenizer = load_tokenizer(a.model)
    pool = BackendPool(
        settings.backends,
        health_interval=a.health_interval,
        health_timeout=a.health_timeout,
        fail_threshold=a.fail_threshold,
        discover_dns=a.discover_dns,
        discover_allow=parse_networks(a.discover_allow),
        max_discovered=a.discover_max,
        dns_interval=a.dns_interval,
        api_key=a.api_key,
    )

    def factory(block_size: int, model_id: str) -> RoutingPolicy:
        logger.info("policy %s hashes blocks of %d tokens for model %r", a.policy, block_size,
                    model_id)  # fmt: skip
        return make_policy(
            a.policy, block_size=block_size, model_id=model_id, balance=settings.balance,
            capacity_blocks=a.prefix_capacity_blocks, hash_algo=a.prefix_caching_hash_algo,
        )  # fmt: skip

    app = create_router_app(
        pool, factory, tokenizer,
        RouterConfig(
            api_key=a.api_key, max_body_bytes=a.max_body_bytes,
            request_timeout_s=a.request_timeout, prefill_timeout_s=a.prefill_timeout,
            idle_timeout_s=a.idle_timeout, policy_name=a.policy,
            open_metrics=a.open_endpoints == "metrics",
            event_endpoints=settings.event_endpoints, event_topic=a.kv_events_topic,
        ),
    )  # fmt: skip
    return pool, app


def run_router(a: argparse.Namespace) -> int:
    """``kvstack router``: validate, build, serve until SIGTERM; 0 on a clean stop."""
    import uvicorn

    from kvstack.serve.api.http_limits import header_deadline_protocol

    class _Server(uvicorn.Server):
        """uvicorn without its own signal capture: the handlers below (as in ``kvstack
        serve``) make a graceful stop return 0 instead of re-raising SIGTERM."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    settings = validate_router_args(a)
    logging.getLogger("kvstack").setLevel(logging.INFO)
    _pool, app = build_router(a, settings)
    targets = list(settings.backends) + ([f"dns:{a.discover_dns}"] if a.discover_dns else [])
    logger.info(
        "kvstack router on http://%s:%d: policy %s over %s", a.host, a.port, a.policy,
        ", ".join(targets),
    )  # fmt: skip
    server = _Server(
        uvicorn.Config(
            app, host=a.host, port=a.port, log_level="info", access_log=False,
            timeout_graceful_shutdown=max(1, int(a.shutdown_grace)),
            http=header_deadline_protocol(HEADER_TIMEOUT_S),
            limit_concurrency=a.max_connections,
        )
    )  # fmt: skip

    def on_signal(signum: int, _frame: object) -> None:
        # First signal: stop accepting, let in-flight requests finish; second: force.
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise ConfigError(f"could not serve on {a.host}:{a.port} (see the log above)")
    logger.info("kvstack router stopped")
    return 0
