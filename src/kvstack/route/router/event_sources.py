"""Where the router reads each backend's KV events: one protocol, two implementations.

``EventSource`` is what ``BackendPool`` runs per backend under ``--policy kv_events``:

* ``sse`` (``events_client.EventFollower``): kvstack's ``GET /v1/kv_events`` stream,
  kvstack's hashes, a snapshot on every connect. The default for every backend.
* ``zmq`` (``events_zmq.ZmqEventFollower``): vLLM's ``KVEventBatch`` msgpack on a PUB
  socket plus its ROUTER replay socket, the publisher's block hashes (vLLM's, or
  kvstack's ``builtin``). Used for a backend the router knows a ZMQ endpoint of.

How the router learns a backend's ZMQ endpoint (``EventEndpoints``):

* ``--kv-events-endpoint BACKEND=PUB[,REPLAY]``: one backend, e.g.
  ``http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558`` (repeatable);
* ``--kv-events-port PORT[,REPLAY_PORT]``: every other backend, static or found by
  ``--discover-dns``, at ``tcp://<the backend's host>:PORT``: a pod's engine publishes
  on its own IP (``--kv-events-config '{"endpoint": "tcp://*:5557", ...}'``).

The router always connects (SUB and DEALER): the publisher must bind, which vLLM does
for an endpoint with ``*`` (``tcp://*:5557``). A bad value is a ``ConfigError`` with
one line (``kvstack router`` exits 2). ``EVENT_SOURCES`` names the two kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from kvstack.core.errors import ConfigError
from kvstack.core.registry import Registry
from kvstack.route.policy.kv_index import EventIndex
from kvstack.route.policy.vllm_index import VllmEventIndex
from kvstack.route.router.discovery import normalize_url
from kvstack.route.router.events_client import EventFollower, EventSink
from kvstack.route.router.events_zmq import ZmqEndpoint, ZmqEventFollower


class EventSource(Protocol):
    """One backend's event follower, as ``BackendPool`` drives it."""

    replica_id: str

    @property
    def running(self) -> bool: ...

    @property
    def fresh(self) -> bool:
        """Whether the policy may trust the index for this backend now."""
        ...

    def start(self) -> None:
        """Start following (idempotent; needs a running event loop)."""

    async def stop(self) -> None: ...

    async def restart(self) -> None:
        """Resync from scratch (the backend was ejected: it may have restarted)."""

    def state(self) -> dict[str, Any]:
        """Counters for ``GET /router/state``."""
        ...


@dataclass(frozen=True)
class SourceContext:
    """What building one backend's source takes: the indexes it feeds and how to reach it."""

    replica_id: str
    url: str
    sse_index: EventSink
    vllm_index: VllmEventIndex
    endpoint: ZmqEndpoint | None = None
    session: aiohttp.ClientSession | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    idle_timeout: float | None = 30.0
    topic: str = ""


def _sse(c: SourceContext) -> EventSource:
    return EventFollower(c.replica_id, c.url, c.sse_index, session=c.session,
                         headers=c.headers, idle_timeout=c.idle_timeout)  # fmt: skip


def _zmq(c: SourceContext) -> EventSource:
    assert c.endpoint is not None
    return ZmqEventFollower(c.replica_id, c.endpoint, c.vllm_index, topic=c.topic)


SourceFactory = Callable[[SourceContext], EventSource]
EVENT_SOURCES: Registry[SourceFactory] = Registry("KV event source")
EVENT_SOURCES.add("sse", _sse, "kvstack's GET /v1/kv_events stream (kvstack's hashes)")
EVENT_SOURCES.add("zmq", _zmq, "vLLM's KVEventBatch on a ZMQ PUB + ROUTER replay socket")

_FLAG = "--kv-events-endpoint"


def parse_zmq_endpoint(text: str, what: str = _FLAG) -> str:
    """A ZMQ endpoint the router can connect to: ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    text = text.strip()
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    if not text.startswith("tcp://"):
        raise ConfigError(f"{what}: {text!r} is not tcp://HOST:PORT or ipc://PATH")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"{what}: {text!r}: {e}") from None
    if not parts.hostname or port is None or not 0 < port < 65536 or parts.path:
        raise ConfigError(f"{what}: {text!r} is not tcp://HOST:PORT (port 1..65535)")
    if "*" in parts.hostname or parts.hostname in ("0.0.0.0", "::"):
        raise ConfigError(
            f"{what}: {text!r} is a bind address; the router connects: give the "
            "publisher's host (the publisher binds tcp://*:PORT)"
        )
    return text


def parse_endpoint_flag(value: str) -> tuple[str, ZmqEndpoint]:
    """``BACKEND=PUB[,REPLAY]`` -> ``(normalized backend URL, endpoint)``."""
    backend, sep, rest = value.partition("=")
    if not sep or not backend.strip() or not rest.strip():
        raise ConfigError(f"{_FLAG} wants BACKEND=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], "
                          f"got {value!r}")  # fmt: skip
    url = normalize_url(backend)
    pub, _, replay = rest.partition(",")
    return url, ZmqEndpoint(
        parse_zmq_endpoint(pub), parse_zmq_endpoint(replay) if replay.strip() else None
    )


def parse_ports_flag(value: str) -> tuple[int, int | None]:
    """``--kv-events-port PORT[,REPLAY_PORT]``."""
    pub, _, replay = value.partition(",")
    ports = []
    for p in (pub, replay) if replay else (pub,):
        if not p.strip().isdigit() or not 0 < int(p) < 65536:
            raise ConfigError(f"--kv-events-port wants PORT[,REPLAY_PORT] (1..65535), "
                              f"got {value!r}")  # fmt: skip
        ports.append(int(p))
    return ports[0], ports[1] if len(ports) > 1 else None


@dataclass(frozen=True)
class EventEndpoints:
    """Which backends the router follows over ZMQ, and where (see the module docstring)."""

    explicit: Mapping[str, ZmqEndpoint] = field(default_factory=dict)
    ports: tuple[int, int | None] | None = None

    @classmethod
    def parse(cls, flags: Iterable[str], ports: str | None) -> EventEndpoints:
        explicit: dict[str, ZmqEndpoint] = {}
        for value in flags:
            url, ep = parse_endpoint_flag(value)
            if url in explicit:
                raise ConfigError(f"{_FLAG}: backend {url} given twice")
            explicit[url] = ep
        return cls(explicit, parse_ports_flag(ports) if ports is not None else None)

    @property
    def any(self) -> bool:
        return bool(self.explicit) or self.ports is not None

    def for_backend(self, url: str) -> ZmqEndpoint | None:
        """The ZMQ endpoint of backend ``url`` (normalized), or None: follow its SSE stream."""
        if url in self.explicit:
            return self.explicit[url]
        if self.ports is None:
            return None
        host = urlsplit(url).hostname or ""
        host = f"[{host}]" if ":" in host else host
        pub, replay = self.ports
        return ZmqEndpoint(
            f"tcp://{host}:{pub}", f"tcp://{host}:{replay}" if replay is not None else None
        )

    def kind(self, url: str) -> str:
        """``EVENT_SOURCES`` name of the source the router uses for ``url``."""
        return "zmq" if self.for_backend(url) is not None else "sse"


@dataclass(frozen=True)
class EventFeeds:
    """The indexes of a ``kv_events`` policy and the endpoints: ``source`` builds each
    backend's follower (``BackendPool.follow_events`` calls it)."""

    sse_index: EventIndex
    vllm_index: VllmEventIndex
    endpoints: EventEndpoints = field(default_factory=EventEndpoints)
    topic: str = ""

    def source(
        self, url: str, session: aiohttp.ClientSession | None, headers: Mapping[str, str],
        idle_timeout: float | None,
    ) -> EventSource:  # fmt: skip
        ctx = SourceContext(url, url, self.sse_index, self.vllm_index,
                            self.endpoints.for_backend(url), session, headers, idle_timeout,
                            self.topic)  # fmt: skip
        return EVENT_SOURCES.get(self.endpoints.kind(url))(ctx)
