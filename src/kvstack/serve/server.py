"""``kvstack serve`` without argparse: server options, ``build_server`` and ``serve``.

``ServerOptions`` declares the server's flags once (help, default, choices), as
``EngineConfig`` declares the engine's; ``kvstack serve`` derives ``--host``,
``--port``... from it and reads them back with ``ServerOptions.from_cli_args``.
``build_server(engine_config, options)`` loads the model and builds the app; it is
shared by ``kvstack serve`` and each Ray Serve replica (``kvstack.route.ray``), which
receive these two frozen objects, never a parsed command line.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstack.config.engine import EngineConfig
from kvstack.core.errors import ConfigError
from kvstack.core.options import Switch, check_choices, from_namespace, option
from kvstack.kv.tiers.redis_url import redacted_spec
from kvstack.serve.api.endpoints import DEFAULT_OPEN_ENDPOINTS, open_endpoints
from kvstack.serve.api.served_names import default_served_names
from kvstack.serve.conversation_options import ConversationOptions
from kvstack.serve.frontend_options import FrontendOptions

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from kvstack.engine.llm import LLM
    from kvstack.serve.async_engine import AsyncEngine

logger = logging.getLogger("kvstack.serve")
SERVER = "server"
ROLES = ("both", "prefill", "decode")  # --role: an ordinary server, or one side of a P/D split


@dataclass(frozen=True)
class ServerOptions:
    """How the HTTP server runs; ``port`` in 1..65535 and ``max_waiting`` >= 1."""

    host: str = option("127.0.0.1", "address to bind (default 127.0.0.1)", group=SERVER)
    port: int = option(8000, "port (default 8000)", group=SERVER)
    served_model_name: tuple[str, ...] | None = option(
        None,
        "model id(s) clients send and /v1/models lists, as vLLM's: the first is the name "
        "in responses and metrics, the others are accepted aliases (default: the model "
        "as given, then the file's name as an alias, as vLLM)",
        group=SERVER, nargs="+", metavar="NAME", convert=lambda v: _names(v),
    )  # fmt: skip
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on /v1/* and cache endpoints "
        "(default: $KVSTACK_API_KEY, else vLLM's $VLLM_API_KEY; none = open)",
        group=SERVER, env=("KVSTACK_API_KEY", "VLLM_API_KEY"),
    )  # fmt: skip
    open_endpoints: str = option(
        DEFAULT_OPEN_ENDPOINTS,
        "with --api-key, which of tokenize,detokenize,load,metrics,openapi need no key "
        "(comma list, or 'none'); default metrics,openapi as vLLM (Prometheus scrapes "
        "without one). /health and /version are always open. See SECURITY.md",
        group=SERVER,
    )
    max_waiting: int = option(
        1024,
        "requests that may wait for a first schedule; past it new ones get 429",
        group=SERVER,
    )
    max_sequences_per_request: int = option(
        64,
        "prompts x n one request may ask for (a batch of 32 prompts with n=16 is 512); "
        "past it 400, so one client cannot fill --max-waiting",
        group=SERVER,
    )
    request_timeout: float | None = option(
        None,
        "seconds after which a request is aborted and answered 408 (default: none)",
        group=SERVER,
    )
    request_log: str | None = option(
        None,
        "append one JSON line per finished request (timestamps, prompt token ids, "
        "session id, cached tokens, output length) for `kvstack analyze`",
        group=SERVER,
    )
    max_body_bytes: int = option(
        8 * 1024 * 1024, "larger request bodies get 413 (default 8 MiB)", group=SERVER
    )
    header_timeout: float = option(
        10.0,
        "seconds a connection may take to send a request's headers before it is closed "
        "(slowloris; uvicorn has no such limit)",
        group=SERVER,
    )
    body_timeout: float = option(
        30.0, "seconds a request's body may take to arrive before 408", group=SERVER
    )
    max_connections: int = option(
        2048,
        "open connections (streams included) served at once; a request on one more "
        "gets 503 (uvicorn's limit_concurrency, which counts the asking connection)",
        group=SERVER,
    )
    role: str = option(
        "both",
        "prefill/decode split behind `kvstack router`: a prefill replica computes the "
        "prompt's KV, waits until its --kv-offload tiers hold it and answers one token; a "
        "decode replica loads that KV from the shared tier instead of recomputing it. Both "
        "need --kv-offload with a tier they share (redis://..., or one disk folder). "
        "Default both: an ordinary server",
        group=SERVER, choices=lambda: ROLES,
    )  # fmt: skip
    shutdown_grace: float = option(
        30.0,
        "on SIGTERM, seconds to let in-flight requests finish before aborting them",
        group=SERVER,
    )
    tool_call_parser: str = option(
        "hermes",
        "how tool calls are read from the output under tool_choice auto (vLLM's flag); "
        "the default model's prompt asks for hermes' <tool_call>{json}</tool_call>",
        group=SERVER, choices=lambda: _tool_parsers(),
    )  # fmt: skip
    enable_auto_tool_choice: bool = option(
        False,
        "parse tool calls under tool_choice auto (off by default as in vLLM: a request "
        "with tools and tool_choice auto, or tools alone, gets vLLM's 400)",
        group=SERVER, switches=(Switch("--no-enable-auto-tool-choice", False, "the default: "
                                       "tool_choice auto is 400, as vLLM without the flag"),),
    )  # fmt: skip

    allowed_origins: tuple[str, ...] | None = option(
        None,
        "CORS: origins browsers may call from, a JSON list as vLLM's ('[\"*\"]') or "
        "comma-separated (default: none, no CORS headers; vLLM defaults to [\"*\"])",
        group=SERVER, metavar="JSON_LIST", convert=lambda v: _origins(v),
    )  # fmt: skip
    root_path: str | None = option(
        None,
        "path prefix a reverse proxy serves the API under (vLLM's --root-path; ASGI root_path)",
        group=SERVER,
    )
    kv_events_config: str | None = option(
        None,
        "publish KV events as vLLM does, for llm-d's KV indexer, Dynamo or LMCache: "
        'vLLM\'s KVEventsConfig JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": '
        '"kv"}\' (msgpack KVEventBatch on a ZMQ PUB socket plus a ROUTER replay socket; '
        "GET /v1/kv_events streams the same events as JSON either way)",
        group=SERVER, metavar="JSON",
    )  # fmt: skip
    prefix_caching_hash_algo: str = option(
        "sha256",
        "block hashes the ZMQ KV events carry, computed as vLLM computes its prefix-cache "
        "hashes so an external indexer can recompute them from token ids: sha256 (vLLM's "
        "default, SHA-256 of a pickle), sha256_cbor (SHA-256 of canonical CBOR, "
        "language-neutral), xxhash / xxhash_cbor (XXH3-128; seeded at random per "
        "process unless PYTHONHASHSEED is set, as in vLLM) or builtin (kvstack's own "
        "BLAKE2b chain, as GET /v1/kv_events has it)",
        group=SERVER, choices=lambda: _hash_algos(),
    )  # fmt: skip
    conversation: ConversationOptions = field(default_factory=ConversationOptions)  # a part
    frontend: FrontendOptions = FrontendOptions()  # noqa: RUF009 (vLLM's front end; frozen)

    def __post_init__(self) -> None:
        # Built directly (Ray, tests) rather than through ``build``: normalise the same way.
        if self.served_model_name is not None:
            object.__setattr__(self, "served_model_name", _names(self.served_model_name))
        if self.allowed_origins is not None:
            object.__setattr__(self, "allowed_origins", _origins(self.allowed_origins))
        if self.kv_events_config is not None:
            from kvstack.serve.events.config import KVEventsConfig

            KVEventsConfig.parse(self.kv_events_config)  # one clear line at startup
        if self.max_waiting < 1:
            raise ConfigError(f"--max-waiting must be at least 1, got {self.max_waiting}")
        open_endpoints(self.open_endpoints)  # ConfigError for an unknown name
        for flag, value in (("--header-timeout", self.header_timeout),
                            ("--body-timeout", self.body_timeout),
                            ("--max-connections", self.max_connections)):  # fmt: skip
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if self.max_sequences_per_request < 1:
            raise ConfigError(
                "--max-sequences-per-request must be at least 1, "
                f"got {self.max_sequences_per_request}"
            )
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        check_choices(self)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerOptions:
        return from_namespace(cls, args)

    def check(self, engine: EngineConfig) -> None:
        """``ConfigError`` if these options cannot serve ``engine`` (before loading it)."""
        if self.role != "both" and not engine.cache.kv_offload:
            raise ConfigError(
                f"--role {self.role} needs --kv-offload with a tier the replicas share "
                "(e.g. redis://127.0.0.1:6379): that is how the prompt's KV moves"
            )


def _names(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"--served-model-name needs non-empty names, got {value!r}")
    return names


def _origins(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``'["*"]'`` (vLLM's JSON) or ``a.com,b.com`` -> a tuple (idempotent)."""
    if isinstance(value, list | tuple):
        items: Any = list(value)
    elif value.strip().startswith("["):
        import json

        try:
            items = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--allowed-origins is not a JSON list: {e}") from None
    else:
        items = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(items, list) or not all(isinstance(o, str) and o for o in items):
        raise ConfigError(f"--allowed-origins must be a list of origins, got {value!r}")
    return tuple(items)


def _hash_algos() -> tuple[str, ...]:
    from kvstack.kv.vllm_hashing import HASH_ALGOS

    return HASH_ALGOS


def _tool_parsers() -> tuple[str, ...]:
    from kvstack.serve.chat.tool_parsers import TOOL_PARSERS

    return TOOL_PARSERS.names()


def cache_config_info(config: EngineConfig, num_blocks: int) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info``: vLLM's ``CacheConfig`` names where kvstack has
    the setting (``num_gpu_blocks`` is the pool's blocks, in RAM here), then kvstack's."""
    c = config.cache
    return {
        "block_size": str(c.block_size),
        "cache_dtype": c.kv_cache_dtype,
        "enable_prefix_caching": str(c.prefix_cache != "none"),
        "num_gpu_blocks": str(num_blocks),
        "prefix_cache": c.prefix_cache,
        "eviction_policy": c.eviction_policy,
        "kv_layout": c.kv_layout,
        "kv_offload": redacted_spec(str(c.kv_offload)),  # no Redis password in a label
        "kv_press": str(c.kv_press),
    }


def build_server(
    engine_config: EngineConfig, options: ServerOptions, kv_events: Any = None
) -> tuple[LLM, AsyncEngine, FastAPI, str]:
    """Check the options, load the model and build ``(llm, async engine, app, name)``.
    ``kv_events``: the ZMQ publisher ``bind_kv_events`` bound before the load, if any."""
    from kvstack.engine.llm import LLM
    from kvstack.serve.api.app import ServerConfig, create_app
    from kvstack.serve.async_engine import AsyncEngine
    from kvstack.serve.metrics.server import ServerMetrics

    options.check(engine_config)
    llm = LLM.from_config(engine_config)
    names = options.served_model_name or default_served_names(engine_config.model)
    name = names[0]
    eng = llm.engine
    metrics = ServerMetrics(
        name, eng.max_model_len, cache_config_info(engine_config, eng.kv_manager.num_blocks),
        kv_cache_metrics=engine_config.cache.kv_cache_metrics,
    )  # fmt: skip
    engine = AsyncEngine(
        llm.engine, max_waiting=options.max_waiting, metrics=metrics,
        request_log=options.request_log,
    )  # fmt: skip
    app = create_app(
        engine,
        ServerConfig(
            model_name=name,
            model_aliases=names[1:],
            allowed_origins=options.allowed_origins or (),
            api_key=options.api_key,
            open_endpoints=open_endpoints(options.open_endpoints),
            max_body_bytes=options.max_body_bytes,
            body_timeout_s=options.body_timeout,
            request_timeout_s=options.request_timeout,
            max_sequences_per_request=options.max_sequences_per_request,
            shutdown_grace_s=options.shutdown_grace,
            role=options.role,
            tool_call_parser=options.tool_call_parser,
            enable_auto_tool_choice=options.enable_auto_tool_choice,
            conversation=options.conversation,
            frontend=options.frontend,
            identity=repr(engine_config),
        ),
    )
    pub = kv_events if kv_events is not None else bind_kv_events(options)
    if pub is not None:
        from kvstack.serve.events.vllm import VllmEventTranslator, int_block_hashes_from_env

        translator = VllmEventTranslator(
            options.prefix_caching_hash_algo, int_block_hashes_from_env()
        )
        pub.start(translator, llm.engine.kv_events)
        metrics.kv_events_dropped = lambda: pub.num_dropped
    app.state.kv_events_publisher = pub
    return llm, engine, app, name


def bind_kv_events(options: ServerOptions) -> Any:
    """vLLM's ZMQ publisher, its sockets bound (not started), if ``--kv-events-config``
    asks for one; an endpoint that cannot bind is a ``ConfigError`` now, before the model
    loads, as a port in use is (``bind_http``)."""
    from kvstack.serve.events.config import KVEventsConfig

    if options.kv_events_config is None:
        return None
    config = KVEventsConfig.parse(options.kv_events_config)
    if not config.publishes:
        return None
    from kvstack.kv.vllm_hashing import hash_function
    from kvstack.serve.events.vllm import int_block_hashes_from_env
    from kvstack.serve.events.zmq import ZmqKVEventPublisher

    if options.prefix_caching_hash_algo != "builtin":
        hash_function(options.prefix_caching_hash_algo)  # xxhash without its package: now
    int_block_hashes_from_env()  # a malformed VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: now
    return ZmqKVEventPublisher(config)


def bind_http(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything slow happens (as vLLM does)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"cannot serve on {host}:{port}: {e.strerror or e} (another server there? "
            "choose --port)"
        ) from None
    return sock


def uvicorn_config(app: FastAPI, o: ServerOptions) -> uvicorn.Config:
    """How uvicorn serves ``app``: the header deadline (``http_limits``) and the
    connection cap of ``o`` (against slowloris clients)."""
    import uvicorn

    from kvstack.serve.api.http_limits import header_deadline_protocol

    return uvicorn.Config(
        app,
        host=o.host,
        port=o.port,
        **o.frontend.uvicorn_kwargs(),
        root_path=o.root_path or "",
        timeout_graceful_shutdown=int(o.shutdown_grace) + 5,
        http=header_deadline_protocol(o.header_timeout),
        # uvicorn refuses when len(connections) >= limit, the asking one included:
        # + 1 makes --max-connections N serve N connections and refuse the N + 1st.
        limit_concurrency=o.max_connections + 1,
    )


def serve(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Serve until SIGTERM/SIGINT: the engine loop in this thread, HTTP in another."""
    import uvicorn

    logging.getLogger("kvstack").setLevel(logging.INFO)
    o = options
    sock = bind_http(o.host, o.port)  # a port in use fails now, not after the model loads
    pub = None
    try:
        pub = bind_kv_events(o)  # so does a ZMQ endpoint that cannot bind
        llm, engine, app, name = build_server(engine_config, o, pub)
    except BaseException:
        if pub is not None:
            pub.close()
        sock.close()
        raise
    logger.info("kvstack serving %s on http://%s:%d (role %s)", name, o.host, o.port, o.role)
    server = uvicorn.Server(uvicorn_config(app, o))

    def on_signal(signum: int, _frame: object) -> None:
        # First signal: graceful (stop accepting, finish in-flight requests up to
        # --shutdown-grace, then the lifespan shutdown stops the engine); second: force.
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
        app.state.kv_state.close()  # web view streams never end by themselves

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # The engine loop runs in the main thread and HTTP in a second one (see
    # AsyncEngine.run_forever); uvicorn skips installing signal handlers off the main thread.
    engine.mark_running()
    http = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="kvstack-http", daemon=True
    )
    http.start()
    try:
        engine.run_forever(keep_going=http.is_alive)
        http.join(timeout=o.shutdown_grace + 10)
        kv_ok = check_kv_at_exit(llm)
    finally:
        llm.shutdown()  # offload tiers: write queued stores so a restart finds them
        if app.state.kv_events_publisher is not None:
            app.state.kv_events_publisher.close()
        sock.close()
    if not server.started:
        raise ConfigError(f"could not serve on {o.host}:{o.port} (see the log above)")
    return 0 if kv_ok else 1


def check_kv_at_exit(llm: LLM) -> bool:
    """After the engine loop stopped (this thread ran it): ``check_integrity()`` and the
    blocks still held by requests, logged (``benchmarks/soak.py`` reads the line); False
    (exit status 1) if the bookkeeping is broken or a finished server still holds KV."""
    eng = llm.engine
    total = eng.kv_manager.num_blocks
    try:
        eng.check_integrity()
        eng.kv_manager.check_integrity()
    except AssertionError as e:
        logger.error("KV at exit: integrity check FAILED: %s", e)
        return False
    held = total - eng.num_free_blocks - eng.num_pinned_blocks()
    log = logger.info if held == 0 else logger.error
    log("KV at exit: integrity ok, %d of %d blocks held by requests", held, total)
    return held == 0
