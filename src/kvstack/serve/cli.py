"""``kvstack serve``: the OpenAI-compatible server on 127.0.0.1:8000 by default."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from kvstack.errors import ConfigError

logger = logging.getLogger("kvstack.serve")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send and /v1/models lists (default: the model file's name)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("KVSTACK_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* and cache endpoints "
        "(default: $KVSTACK_API_KEY; none = open)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests that may wait for a first schedule; past it new ones get 429",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds after which a request is aborted and answered 408 (default: none)",
    )
    g.add_argument(
        "--request-log",
        default=None,
        help="append one JSON line per finished request (timestamps, prompt token ids, "
        "session id, cached tokens, output length) for `kvstack analyze`",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="larger request bodies get 413 (default 8 MiB)",
    )
    g.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="prefill/decode split behind `kvstack router`: a prefill replica computes the "
        "prompt's KV, waits until its --kv-offload tiers hold it and answers one token; a "
        "decode replica loads that KV from the shared tier instead of recomputing it. Both "
        "need --kv-offload with a tier they share (redis://..., or one disk folder). "
        "Default both: an ordinary server",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before aborting them",
    )


def default_served_name(model: str) -> str:
    """The model file's stem (``SmolLM2-135M-Instruct.Q4_1``) or the HF folder's name."""
    from kvstack.model.registry import resolve_model_path

    path = Path(resolve_model_path(model))
    return path.stem if path.is_file() else path.name


def build_server(a: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    """Check the server options, load the model and build ``(llm, async engine, app, name)``.

    Shared by ``kvstack serve`` and each Ray Serve replica (``route/ray_serve.py``).
    """
    from kvstack.cli import build_llm
    from kvstack.serve.app import ServerConfig, create_app
    from kvstack.serve.async_engine import AsyncEngine
    from kvstack.serve.metrics import ServerMetrics

    if a.max_waiting < 1:
        raise ConfigError(f"--max-waiting must be at least 1, got {a.max_waiting}")
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {a.port}")
    if a.role != "both" and not a.kv_offload:
        raise ConfigError(
            f"--role {a.role} needs --kv-offload with a tier the replicas share "
            "(e.g. redis://127.0.0.1:6379): that is how the prompt's KV moves"
        )
    llm = build_llm(a)
    name = a.served_model_name or default_served_name(a.model)
    metrics = ServerMetrics(name)
    engine = AsyncEngine(
        llm.engine, max_waiting=a.max_waiting, metrics=metrics, request_log=a.request_log
    )
    app = create_app(
        engine,
        ServerConfig(
            model_name=name,
            api_key=a.api_key,
            max_body_bytes=a.max_body_bytes,
            request_timeout_s=a.request_timeout,
            shutdown_grace_s=a.shutdown_grace,
            role=a.role,
        ),
    )
    return llm, engine, app, name


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    if getattr(a, "ray", False):
        from kvstack.route.ray_cli import serve_on_ray

        return serve_on_ray(a)
    logging.getLogger("kvstack").setLevel(logging.INFO)
    llm, engine, app, name = build_server(a)
    logger.info("kvstack serving %s on http://%s:%d (role %s)", name, a.host, a.port, a.role)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=a.host,
            port=a.port,
            log_level="info",
            timeout_graceful_shutdown=int(a.shutdown_grace) + 5,
        )
    )

    def on_signal(signum: int, _frame: object) -> None:
        # First signal: graceful (stop accepting, finish in-flight requests up to
        # --shutdown-grace, then the lifespan shutdown stops the engine); second: force.
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # The engine loop runs in the main thread and HTTP in a second one (see
    # AsyncEngine.run_forever); uvicorn skips installing signal handlers off the main thread.
    engine.mark_running()
    http = threading.Thread(target=server.run, name="kvstack-http", daemon=True)
    http.start()
    try:
        engine.run_forever(keep_going=http.is_alive)
        http.join(timeout=a.shutdown_grace + 10)
    finally:
        llm.shutdown()  # offload tiers: write queued stores so a restart finds them
    if not server.started:
        raise ConfigError(f"could not serve on {a.host}:{a.port} (see the log above)")
    return 0
