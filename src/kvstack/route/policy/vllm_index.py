"""What each replica caches, from its ZMQ KV events on vLLM's wire, keyed by vLLM's hashes.

llm-d's KV-cache indexer in the router: every backend's PUB socket sends
``KVEventBatch`` es (``vllm_events.decode_batch``); ``VllmEventIndex`` keeps, per
replica and medium, the set of block hashes announced stored and not since removed.
The hashes are the engine's own (vLLM's ``hash_block_tokens`` chain, or kvstack's
``builtin`` chain when a kvstack replica publishes it), so to ask "how much of this
prompt does replica R hold" the router recomputes them from the prompt's token ids:
``RequestHashes.vllm`` with the router's ``--prefix-caching-hash-algo``, the block
size the replica's ``BlockStored`` events announce, its ``PYTHONHASHSEED`` convention
and the request's ``cache_salt`` (``kv/vllm_hashing.py`` says what must match).

Unlike kvstack's SSE stream there is no snapshot: a view holds what was announced since
the subscriber's history began (the replay socket's oldest buffered batch, or the last
loss), so it is a *subset* of the replica's cache, never a superset; a loss it cannot
repair (``clear``) empties it rather than keep hashes that may be gone. A view is
*fresh* while its subscriber is connected (``resume`` / ``suspend``); a stale replica
is matched by the policy's approximate index instead. Only KV cache group 0 is indexed
(a hybrid model's other groups repeat the same prefix under other groups).

Invariants (``check_integrity``): every hash is ``bytes``; a view that knows its block
size has ``block_size >= 1``; a view holds at most ``max_blocks`` hashes (more empties
it, counted in ``num_overflows``); a stale view may keep blocks (resumed after a replay).
Plain bookkeeping, not thread-safe: the router's event loop calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstack.kv.segments import segment_key, segment_namespace
from kvstack.kv.vllm_hashing import hash_prompt
from kvstack.route.policy.base import RouteRequest
from kvstack.route.policy.kv_index import BlockHasher
from kvstack.route.policy.vllm_events import VllmCleared, VllmEvent, VllmRemoved, int_key


@dataclass
class _View:
    fresh: bool = False
    block_size: int | None = None
    int_hashes: bool = False
    mediums: dict[str, set[bytes]] = field(default_factory=dict)
    events: int = 0


class VllmEventIndex:
    """Per-replica block sets fed by decoded vLLM events (see the module docstring)."""

    def __init__(self, max_blocks: int = 1 << 21) -> None:
        self._views: dict[str, _View] = {}
        self.max_blocks = max_blocks  # per replica: past it the view is cleared (counted)
        self.num_ignored_groups = 0  # events of a KV cache group other than 0
        self.num_overflows = 0

    def _view(self, replica_id: str) -> _View:
        return self._views.setdefault(replica_id, _View())

    def apply(self, replica_id: str, events: Sequence[VllmEvent]) -> None:
        """Apply one batch's events, in order."""
        view = self._view(replica_id)
        for ev in events:
            view.events += 1
            if isinstance(ev, VllmCleared):
                view.mediums.clear()
                continue
            if ev.group_idx != 0:
                self.num_ignored_groups += 1
                continue
            blocks = view.mediums.setdefault(ev.medium, set())
            if isinstance(ev, VllmRemoved):
                blocks.difference_update(ev.block_hashes)
                continue
            if ev.block_size != view.block_size or ev.int_hashes != view.int_hashes:
                # A new block size (or hash form) means a restarted engine: old keys are void.
                if view.block_size is not None:
                    view.mediums.clear()
                    blocks = view.mediums.setdefault(ev.medium, set())
                view.block_size, view.int_hashes = ev.block_size, ev.int_hashes
            blocks.update(ev.block_hashes)
            if sum(len(b) for b in view.mediums.values()) > self.max_blocks:
                view.mediums.clear()  # a publisher that never removes: forget, never grow
                self.num_overflows += 1

    def clear(self, replica_id: str) -> None:
        """Forget the replica's blocks (a loss the replay could not repair, a restart)."""
        self._view(replica_id).mediums.clear()

    def suspend(self, replica_id: str) -> None:
        """The subscriber lost the publisher: stale, blocks kept for a replay to resume."""
        self._view(replica_id).fresh = False

    def resume(self, replica_id: str) -> None:
        self._view(replica_id).fresh = True

    def is_fresh(self, replica_id: str) -> bool:
        view = self._views.get(replica_id)
        return view is not None and view.fresh

    def keyspace(self, replica_id: str) -> tuple[int, bool] | None:
        """``(block_size, int_hashes)`` of a fresh replica that has announced a block."""
        view = self._views.get(replica_id)
        if view is None or not view.fresh or view.block_size is None:
            return None
        return view.block_size, view.int_hashes

    def match(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """Leading ``hashes`` the replica holds in any medium (0 while stale)."""
        view = self._views.get(replica_id)
        if view is None or not view.fresh:
            return 0
        held = [s for s in view.mediums.values() if s]
        n = 0
        for h in hashes:
            if not any(h in s for s in held):
                break
            n += 1
        return n

    def num_blocks(self, replica_id: str, medium: str = "GPU") -> int:
        view = self._views.get(replica_id)
        return 0 if view is None else len(view.mediums.get(medium, ()))

    def remove_replica(self, replica_id: str) -> None:
        self._views.pop(replica_id, None)

    def check_integrity(self) -> None:
        for rid, view in self._views.items():
            assert view.block_size is None or view.block_size >= 1, f"{rid}: block size"
            assert sum(len(b) for b in view.mediums.values()) <= self.max_blocks, rid
            for medium, blocks in view.mediums.items():
                assert isinstance(medium, str), f"{rid}: medium {medium!r}"
                assert all(isinstance(h, bytes) for h in blocks), f"{rid}: a hash not bytes"


class RequestHashes:
    """One request's block hashes in every keyspace a replica uses, each computed once.

    ``kvstack``: the router's own chain (``BlockHasher``: the approximate index, the SSE
    stream). ``vllm(block_size, int_hashes)``: what a ZMQ publisher with ``algo`` would
    name the prompt's blocks (vLLM's chain; kvstack's chain for ``builtin``).
    """

    def __init__(self, req: RouteRequest, hasher: BlockHasher, algo: str) -> None:
        self.req = req
        self.hasher = hasher
        self.algo = algo
        self.kvstack: tuple[bytes, ...] = tuple(hasher.hashes(req.token_ids, req.cache_salt))
        self._vllm: dict[tuple[int, bool], tuple[bytes, ...]] = {}
        self._segments: tuple[bytes, ...] | None = None

    def segment_keys(self) -> tuple[bytes, ...]:
        """The engine's key of each of the request's segments (``kv/segments.py``)."""
        if self._segments is None:
            req, keys = self.req, []
            for mark in req.segments:  # (start, end) or (start, end, primer)
                lead = (*req.sink, *(mark[2] if len(mark) > 2 else ()))
                ns = segment_namespace(self.hasher.model_id, req.cache_salt, lead)
                keys.append(segment_key(ns, req.token_ids[mark[0] : mark[1]]))
            self._segments = tuple(keys)
        return self._segments

    def vllm(self, block_size: int, int_hashes: bool) -> tuple[bytes, ...]:
        key = (block_size, int_hashes)
        if key not in self._vllm:
            ids, salt = self.req.token_ids, self.req.cache_salt
            if self.algo == "builtin":
                hashes = BlockHasher(block_size, self.hasher.model_id).hashes(ids, salt)
            else:
                hashes = hash_prompt(self.algo, ids, block_size, salt)
            if int_hashes:
                hashes = [int_key(int.from_bytes(h, "big")) for h in hashes]
            self._vllm[key] = tuple(hashes)
        return self._vllm[key]
