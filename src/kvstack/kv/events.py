"""KV cache events: which prefix blocks a cache stored and removed (vLLM ``kv_events``).

A router (KV-aware routing) or the cache analyzer keeps its own index of what each
engine holds by consuming this stream instead of polling. The shapes follow vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``:

* ``BlockStored``: consecutive full blocks of one sequence became reusable. Their
  hashes form a chain: ``block_hashes[0]``'s parent is ``parent_block_hash`` (None for
  the first block of a sequence); ``token_ids`` holds ``len(block_hashes) * block_size``
  tokens for the device pool, and is empty for an offload tier's store (``medium`` =
  "host", "disk", "redis": tiers keep no token ids, and their blocks need not be
  consecutive).
  ``cache_salt`` is the request's salt when the run starts at the sequence's first block
  (``parent_block_hash`` None), so a publisher can hash it as vLLM does (vLLM puts the
  salt in the first block's extra keys); ``to_dict`` (the SSE stream) leaves it out.
* ``BlockRemoved``: these hashes are no longer served by ``medium`` (evicted or dropped).
* ``AllBlocksCleared``: the medium's cache was reset.
* ``SegmentStored`` / ``SegmentRemoved`` (kvstack's own, for segment reuse): a segment entry
  (``kv/segments.py``: a tool schema's or a document's standalone KV, reusable at any
  offset) became ready / was evicted. ``segment_key`` is the hash of the segment's tokens
  under the model/salt/sink namespace, not a chain hash; ``token_ids`` are the segment's
  tokens. vLLM has no such events: the vLLM-wire ZMQ publisher leaves them out.

``KVEventLog`` buffers events (bounded: the oldest are dropped and counted when nobody
drains them) and calls subscribers synchronously.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = "device"
    cache_salt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        parent = self.parent_block_hash
        return {
            "type": "BlockStored",
            "block_hashes": [h.hex() for h in self.block_hashes],
            "parent_block_hash": None if parent is None else parent.hex(),
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "medium": self.medium,
        }


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str = "device"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "BlockRemoved",
            "block_hashes": [h.hex() for h in self.block_hashes],
            "medium": self.medium,
        }


@dataclass(frozen=True)
class AllBlocksCleared:
    medium: str = "device"

    def to_dict(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared", "medium": self.medium}


@dataclass(frozen=True)
class SegmentStored:
    segment_key: bytes
    num_tokens: int
    token_ids: list[int]
    block_size: int
    medium: str = "device"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "SegmentStored",
            "segment_key": self.segment_key.hex(),
            "num_tokens": self.num_tokens,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "medium": self.medium,
        }


@dataclass(frozen=True)
class SegmentRemoved:
    segment_keys: list[bytes]
    medium: str = "device"

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "SegmentRemoved",
            "segment_keys": [k.hex() for k in self.segment_keys],
            "medium": self.medium,
        }


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | SegmentStored | SegmentRemoved


def event_weight(event: KVEvent) -> int:
    """What an event costs to keep, in items (token ids + hashes + 1): buffers are bounded
    by weight, since one long prompt's ``BlockStored`` carries all its token ids."""
    if isinstance(event, AllBlocksCleared):
        return 1
    if isinstance(event, SegmentStored):
        return 2 + len(event.token_ids)
    if isinstance(event, SegmentRemoved):
        return 1 + len(event.segment_keys)
    ids = event.token_ids if isinstance(event, BlockStored) else ()
    return 1 + len(event.block_hashes) + len(ids)


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]

    def to_dict(self) -> dict[str, Any]:
        return {"ts": self.ts, "events": [e.to_dict() for e in self.events]}


@dataclass
class KVEventLog:
    """Bounded buffer of events plus synchronous subscribers.

    The buffer (for ``drain``) holds at most ``max_buffered`` weight (``event_weight``:
    token ids + hashes); past it the oldest events are dropped and counted.
    """

    max_buffered: int = 1_000_000
    enabled: bool = True
    _buffer: deque[KVEvent] = field(default_factory=deque)
    _subscribers: list[Callable[[KVEvent], None]] = field(default_factory=list)
    _weight: int = 0
    num_dropped: int = 0
    # The engine thread publishes the device cache's events, the offload I/O thread the
    # tiers' (subscribers are called under this lock, so they see one order).
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, event: KVEvent) -> None:
        if not self.enabled:
            return
        with self._lock:
            for fn in self._subscribers:
                fn(event)
            self._buffer.append(event)
            self._weight += event_weight(event)
            while self._weight > self.max_buffered and len(self._buffer) > 1:
                self._weight -= event_weight(self._buffer.popleft())
                self.num_dropped += 1

    def subscribe(self, fn: Callable[[KVEvent], None]) -> None:
        self._subscribers.append(fn)

    def drain(self) -> KVEventBatch:
        """Return and forget everything buffered since the last drain."""
        with self._lock:
            events = list(self._buffer)
            self._buffer.clear()
            self._weight = 0
        return KVEventBatch(time.time(), events)
