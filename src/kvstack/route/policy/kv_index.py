"""What each replica caches, as seen from the router: block hashes of prefixes.

A request's prompt is cut into full blocks and hashed with the engine's own chain
(``kvstack.kv.hashing``), so the router and every replica name a prefix block the same
way. A replica can reuse a request's blocks only as a *leading* run (block ``i`` is
useless without blocks ``0..i-1``), so both indexes answer ``match`` = the number of
leading hashes of the request that the replica holds::

    request:    h0 h1 h2 h3
    replica A:  h0 h1    h3      match 2  (h3 without h2 cannot be reused)
    replica B:     h1 h2 h3      match 0

Two sources of truth, from cheapest to most exact:

* ``ApproxPrefixIndex``: the Gateway API Inference Extension's prefix-cache scorer.
  The router remembers the hashes it *sent* to each replica in a bounded LRU and assumes
  the replica still caches them. No replica cooperation is needed; it is wrong after
  the replica evicts or restarts, which only costs a cache miss.
* ``EventIndex``: llm-d's KV-cache indexer fed by vLLM KV events. Each replica streams
  ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` batches (``GET
  /v1/kv_events``, see ``kvstack.kv.events``), so the index holds exactly what each
  medium serves. A sequence gap or a malformed batch makes the view *stale* (unknown)
  until the next snapshot batch, and the policy then falls back to the approximate index.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstack.core.errors import ConfigError
from kvstack.kv.hashing import DIGEST_SIZE, hash_blocks, root_hash

logger = logging.getLogger("kvstack.route")

#: The shared remote tier: a block there is equally close to every replica, so it never
#: makes one replica preferable to another and is left out of ``EventIndex.match``.
SHARED_MEDIUM = "redis"


class BlockHasher:
    """The engine's own prefix hash chain (``kvstack.kv.hashing``): ``root_hash(model_id,
    salt)``, then ``hash_blocks(token_ids, block_size, root)``. Full blocks only.

    ``model_id`` must be what the replicas feed to ``root_hash`` (their ``/load``
    ``model_id``) and ``block_size`` their block size, or no hash will ever match.
    """

    def __init__(self, block_size: int, model_id: str) -> None:
        if block_size < 1:
            raise ConfigError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.model_id = model_id

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The chained hashes of the full blocks of ``token_ids`` (a partial tail has none)."""
        return hash_blocks(token_ids, self.block_size, root_hash(self.model_id, cache_salt))


def _leading(hashes: Sequence[bytes], held: Container[bytes]) -> int:
    """Length of the leading run of ``hashes`` that are ``in held``."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class ApproxPrefixIndex:
    """Per replica an LRU (``OrderedDict``) of block hashes the router *sent* there, at most
    ``capacity_blocks`` per replica (Gateway API Inference Extension's prefix scorer).

    ``record`` inserts a request's chain tail first, so its first blocks are the most
    recently used and a shared prefix (a system prompt) is forgotten last: evicting a
    chain's head would make the rest of it unmatchable. ``match`` does not touch the LRU
    (it is asked about every replica, but the request goes to one).

    Invariant: every LRU holds 16-byte hashes only and at most ``capacity_blocks`` of them.
    """

    def __init__(self, capacity_blocks: int = 65536) -> None:
        if capacity_blocks < 1:
            raise ConfigError(f"prefix index capacity must be >= 1 block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        """Remember that the blocks ``hashes`` (one chain, head first) went to the replica."""
        if not hashes:
            return
        lru = self._lru.setdefault(replica_id, OrderedDict())
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def match(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` the router last sent to the replica and still holds."""
        lru = self._lru.get(replica_id)
        return 0 if lru is None else _leading(hashes, lru)

    def num_blocks(self, replica_id: str) -> int:
        """How many hashes the index holds for the replica."""
        return len(self._lru.get(replica_id, ()))

    def remove_replica(self, replica_id: str) -> None:
        """Forget the replica (it left the pool); unknown ids are ignored."""
        self._lru.pop(replica_id, None)

    def check_integrity(self) -> None:
        assert self.capacity_blocks >= 1
        for rid, lru in self._lru.items():
            assert isinstance(rid, str), f"replica id {rid!r} is not a str"
            assert len(lru) <= self.capacity_blocks, (
                f"replica {rid}: {len(lru)} hashes > capacity {self.capacity_blocks}"
            )
            for h in lru:
                assert isinstance(h, bytes) and len(h) == DIGEST_SIZE, f"bad hash {h!r}"


class MalformedBatchError(ValueError):
    """A KV event batch does not follow the wire format (internal to ``EventIndex``)."""


def _hash(value: Any) -> bytes:
    if not isinstance(value, str):
        raise MalformedBatchError(f"block hash {value!r} is not a hex string")
    try:
        h = bytes.fromhex(value)
    except ValueError as e:
        raise MalformedBatchError(f"block hash {value!r} is not hex") from e
    if len(h) != DIGEST_SIZE:
        raise MalformedBatchError(f"block hash {value!r} is not {DIGEST_SIZE} bytes")
    return h


def _hash_list(event: Mapping[str, Any], key: str = "block_hashes") -> list[bytes]:
    hashes = event[key]
    if not isinstance(hashes, list):
        raise MalformedBatchError(f"{key} {hashes!r} is not a list")
    return [_hash(h) for h in hashes]


# One parsed event: (type, medium, hashes); hashes are empty for AllBlocksCleared, and
# are segment keys for the segment events (segment reuse: ``kv/segments.py``).
_Op = tuple[str, str, list[bytes]]
_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockSnapshot")
_SEGMENT_TYPES = {"SegmentStored": "segment_key", "SegmentRemoved": "segment_keys",
                  "SegmentSnapshot": "segment_keys"}  # fmt: skip


def _event_keys(kind: str, event: Mapping[str, Any]) -> list[bytes]:
    if kind == "AllBlocksCleared":
        return []
    key = _SEGMENT_TYPES.get(kind, "block_hashes")
    return [_hash(event[key])] if kind == "SegmentStored" else _hash_list(event, key)


def _parse_batch(batch: Any) -> tuple[int, bool, list[_Op]]:
    """``(seq, snapshot, ops)`` of a wire batch; ``MalformedBatchError`` if it is not one.

    The whole batch is parsed before any of it is applied, so a bad event in the middle
    never leaves a half-applied batch behind.
    """
    if not isinstance(batch, Mapping):
        raise MalformedBatchError(f"batch is a {type(batch).__name__}, not an object")
    try:
        seq, snapshot, events = batch["seq"], batch.get("snapshot", False), batch["events"]
        if type(seq) is not int:
            raise MalformedBatchError(f"seq {seq!r} is not an integer")
        if not isinstance(snapshot, bool):
            raise MalformedBatchError(f"snapshot {snapshot!r} is not a boolean")
        if not isinstance(events, list):
            raise MalformedBatchError(f"events {events!r} is not a list")
        ops: list[_Op] = []
        for event in events:
            if not isinstance(event, Mapping):
                raise MalformedBatchError(f"event {event!r} is not an object")
            kind, medium = event["type"], event.get("medium", "device")
            if kind not in _TYPES and kind not in _SEGMENT_TYPES:
                raise MalformedBatchError(f"unknown event type {kind!r}")
            if not isinstance(medium, str):
                raise MalformedBatchError(f"medium {medium!r} is not a string")
            ops.append((kind, medium, _event_keys(kind, event)))
    except KeyError as e:
        raise MalformedBatchError(f"missing key {e}") from e
    return seq, snapshot, ops


@dataclass
class _ReplicaView:
    """One replica's cached blocks and segment entries per medium; meaningful only while
    ``fresh``. A medium's ``AllBlocksCleared`` clears its segments too (the engine resets
    both together: ``/reset_prefix_cache``)."""

    fresh: bool = False
    last_seq: int | None = None
    mediums: dict[str, set[bytes]] = field(default_factory=dict)
    segments: dict[str, set[bytes]] = field(default_factory=dict)

    def make_stale(self) -> None:
        self.fresh, self.last_seq = False, None
        self.mediums.clear()
        self.segments.clear()

    def apply(self, ops: list[_Op]) -> None:
        for kind, medium, hashes in ops:
            if kind in _SEGMENT_TYPES:
                keys = self.segments.setdefault(medium, set())
                if kind == "SegmentStored":
                    keys.update(hashes)
                elif kind == "SegmentRemoved":
                    keys.difference_update(hashes)
                else:  # SegmentSnapshot
                    self.segments[medium] = set(hashes)
                continue
            blocks = self.mediums.setdefault(medium, set())
            if kind == "BlockStored":
                blocks.update(hashes)
            elif kind == "BlockRemoved":
                blocks.difference_update(hashes)
            elif kind == "AllBlocksCleared":
                blocks.clear()
                self.segments.pop(medium, None)
            else:  # BlockSnapshot
                self.mediums[medium] = set(hashes)


class EventIndex:
    """Exact per-replica view of cached blocks, fed by KV event batches (llm-d's KV-cache
    indexer over vLLM KV events). Wire format: ``{"seq", "ts", "snapshot", "events"}``.

    A replica is *fresh* after a snapshot batch and until a sequence gap, a malformed
    batch or ``mark_stale``; a stale (or never seen) replica matches nothing, and its
    batches are ignored until the next snapshot. A snapshot replaces the replica's whole
    view (every medium; the server names each medium it has), then applies its events in
    order. Malformed input never raises out of ``apply``: it marks the replica stale and
    logs one warning on logger ``kvstack.route``.

    Invariants: a stale replica has no expected ``seq`` and no blocks; a fresh one has an
    integer ``last_seq``; every set holds 16-byte hashes only.
    """

    def __init__(self) -> None:
        self._views: dict[str, _ReplicaView] = {}

    def apply(self, replica_id: str, batch: Mapping[str, Any]) -> None:
        """Apply one wire batch received from ``replica_id``'s event stream."""
        view = self._views.setdefault(replica_id, _ReplicaView())
        if not view.fresh and not (isinstance(batch, Mapping) and batch.get("snapshot") is True):
            return  # no snapshot yet, or stale: nothing to apply a delta to
        try:
            seq, snapshot, ops = _parse_batch(batch)
        except MalformedBatchError as e:
            logger.warning("KV events from replica %s: malformed batch (%s); stale", replica_id, e)
            view.make_stale()
            return
        if snapshot:
            view.make_stale()
            view.apply(ops)
            view.fresh, view.last_seq = True, seq
            return
        if view.last_seq is None or seq != view.last_seq + 1:
            logger.warning(
                "KV events from replica %s: seq %d after %s (gap); stale until the next snapshot",
                replica_id,
                seq,
                view.last_seq,
            )
            view.make_stale()
            return
        view.apply(ops)
        view.last_seq = seq

    def is_fresh(self, replica_id: str) -> bool:
        view = self._views.get(replica_id)
        return view is not None and view.fresh

    def mark_stale(self, replica_id: str) -> None:
        """Forget the replica's view until its next snapshot (e.g. its stream dropped)."""
        self._views.setdefault(replica_id, _ReplicaView()).make_stale()

    def match(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """Leading ``hashes`` the replica holds in any medium but the shared ``redis``."""
        view = self._views.get(replica_id)
        if view is None or not view.fresh:
            return 0
        local = [s for m, s in view.mediums.items() if m != SHARED_MEDIUM and s]
        n = 0
        for h in hashes:
            if not any(h in s for s in local):
                break
            n += 1
        return n

    def segments_held(self, replica_id: str, keys: Sequence[bytes]) -> list[bool]:
        """Which segment ``keys`` the replica holds (any medium but the shared one)."""
        view = self._views.get(replica_id)
        if view is None or not view.fresh:
            return [False] * len(keys)
        local = [s for m, s in view.segments.items() if m != SHARED_MEDIUM and s]
        return [any(k in s for s in local) for k in keys]

    def num_segments(self, replica_id: str, medium: str = "device") -> int:
        """How many segment entries the replica's ``medium`` holds (0 while stale)."""
        view = self._views.get(replica_id)
        return 0 if view is None else len(view.segments.get(medium, ()))

    def num_blocks(self, replica_id: str, medium: str = "device") -> int:
        """How many blocks the replica's ``medium`` holds (0 while stale)."""
        view = self._views.get(replica_id)
        return 0 if view is None else len(view.mediums.get(medium, ()))

    def remove_replica(self, replica_id: str) -> None:
        """Forget the replica (it left the pool); unknown ids are ignored."""
        self._views.pop(replica_id, None)

    def check_integrity(self) -> None:
        for rid, view in self._views.items():
            if view.fresh:
                assert type(view.last_seq) is int, f"fresh replica {rid} without a seq"
            else:
                assert view.last_seq is None, f"stale replica {rid} expects a seq"
                assert not view.mediums, f"stale replica {rid} still holds blocks"
                assert not view.segments, f"stale replica {rid} still holds segments"
            for medium, blocks in [*view.mediums.items(), *view.segments.items()]:
                assert isinstance(medium, str), f"replica {rid}: medium {medium!r}"
                for h in blocks:
                    assert isinstance(h, bytes) and len(h) == DIGEST_SIZE, f"bad hash {h!r}"
