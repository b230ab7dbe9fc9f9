"""``--kv-events-config``: vLLM's ``KVEventsConfig`` JSON, field for field.

``'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv"}'`` means what it means to vLLM
(``vllm/config/kv_events.py``): publish ``KVEventBatch`` msgpack frames on a ZMQ PUB
socket (bound for ``*`` / ``::`` / ipc / inproc endpoints, else connected to a
subscriber that binds, as llm-d's indexer does), keep ``buffer_steps`` batches for the
ROUTER replay socket, and hold at most ``max_queue_size`` events between the engine and
the publisher thread (past it events are dropped and counted, never waited for).

Invariant: a parsed config is valid (types, ranges, known keys), so a bad one fails at
startup with one line naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from kvstack.core.errors import ConfigError

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's fields and defaults; ``publisher`` None means zmq if enabled, else null."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether a ZMQ publisher runs."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The config of a JSON object; ``ConfigError`` naming what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in fields:
                raise ConfigError(
                    f"--kv-events-config: unknown field {key!r}; fields are: {', '.join(fields)}"
                )
        for key, value in raw.items():
            _check_type(key, value, fields[key].type)
        config = cls(**raw)
        config.check()
        return config

    def check(self) -> None:
        if self.resolved_publisher not in PUBLISHERS:
            raise ConfigError(
                f"--kv-events-config: publisher {self.publisher!r}; choose one of: "
                + ", ".join(PUBLISHERS)
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--kv-events-config: {name} must be at least 1")
        for name in ("endpoint", "replay_endpoint"):
            ep = getattr(self, name)
            if ep is not None and "://" not in ep:
                raise ConfigError(
                    f"--kv-events-config: {name} {ep!r} is not a ZMQ endpoint "
                    "(tcp://HOST:PORT, ipc://PATH, inproc://NAME)"
                )


_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int,),
    "str": (str,),
    "str | None": (str, type(None)),
}


def _check_type(key: str, value: Any, annotation: Any) -> None:
    want = _TYPES[str(annotation)]
    ok = isinstance(value, want) and not (bool not in want and isinstance(value, bool))
    if not ok:
        kinds = " or ".join("null" if t is type(None) else t.__name__ for t in want)
        raise ConfigError(f"--kv-events-config: {key} must be {kinds}, got {value!r}")
