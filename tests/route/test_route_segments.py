"""Segment entries (segment reuse) in the router: the replicas' ``SegmentStored`` /
``SegmentRemoved`` / ``SegmentSnapshot`` events in ``EventIndex``, and the ``kv_events``
policy crediting a replica with the request's segments it holds."""

from __future__ import annotations

import random
from typing import Any

from kvstack.kv.segments import segment_key, segment_namespace
from kvstack.route.policy import KVEventsPolicy, Replica, RouteRequest, make_policy
from kvstack.route.policy.kv_index import EventIndex
from kvstack.route.policy.vllm_index import RequestHashes

BS = 4
SINK = (1,)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 50_000) for _ in range(n)]


def _batch(seq: int, *events: dict[str, Any], snapshot: bool = False) -> dict[str, Any]:
    return {"seq": seq, "ts": 0.0, "snapshot": snapshot, "events": list(events)}


def _seg_stored(key: bytes) -> dict[str, Any]:
    return {"type": "SegmentStored", "segment_key": key.hex(), "num_tokens": 8,
            "token_ids": [], "block_size": BS, "medium": "device"}  # fmt: skip


def test_event_index_follows_segment_events() -> None:
    a, b = segment_key(b"n", [1, 2]), segment_key(b"n", [3, 4])
    index = EventIndex()
    snap = {"type": "SegmentSnapshot", "segment_keys": [a.hex()], "medium": "device"}
    index.apply("r", _batch(3, snap, snapshot=True))
    assert index.segments_held("r", [a, b]) == [True, False]
    index.apply("r", _batch(4, _seg_stored(b)))
    assert index.segments_held("r", [a, b]) == [True, True] and index.num_segments("r") == 2
    gone = {"type": "SegmentRemoved", "segment_keys": [a.hex()], "medium": "device"}
    index.apply("r", _batch(5, gone))
    assert index.segments_held("r", [a, b]) == [False, True]
    index.apply("r", _batch(6, {"type": "AllBlocksCleared", "medium": "device"}))
    assert index.num_segments("r") == 0  # a reset clears the segment entries too
    index.check_integrity()
    index.apply("r", _batch(7, {"type": "SegmentStored", "medium": "device"}))  # no key
    assert not index.is_fresh("r") and index.segments_held("r", [b]) == [False]
    index.check_integrity()


def test_kv_events_policy_credits_held_segments() -> None:
    """Two tools of 24 and 16 tokens after an 8-token system prompt: replica ``a`` holds
    both as segment entries, ``b`` holds the system prompt's blocks only."""
    policy = make_policy("kv_events", block_size=BS, model_id="m")
    assert isinstance(policy, KVEventsPolicy)
    system, t1, t2, ask = _tokens(1, 8), _tokens(2, 24), _tokens(3, 16), _tokens(4, 6)
    ids = [*system, *t1, *t2, *ask]
    spans = ((8, 32), (32, 48))
    req = RouteRequest(ids, None, spans, SINK)
    ns = segment_namespace("m", None, SINK)
    keys = [segment_key(ns, ids[a:b]) for a, b in spans]
    prefix = policy.hasher.hashes(system)
    snap_a = {"type": "SegmentSnapshot", "segment_keys": [k.hex() for k in keys]}
    blocks = {"type": "BlockSnapshot", "block_hashes": [h.hex() for h in prefix]}
    policy.index.apply("a", _batch(0, snap_a, snapshot=True))
    policy.index.apply("b", _batch(0, blocks, snapshot=True))
    reps = [Replica("a"), Replica("b")]
    decision = policy.choose(req, reps)
    assert (decision.replica_id, decision.reason) == ("a", "affinity")
    assert decision.matched_blocks == 40 // BS  # the two segments' tokens, in blocks
    # With the system prompt cached too, the segments count after its two blocks.
    policy.index.apply("a", _batch(1, {"type": "BlockStored", "block_hashes":
                                       [h.hex() for h in prefix], "parent_block_hash": None,
                                       "token_ids": [], "block_size": BS}))  # fmt: skip
    assert policy.choose(req, reps).matched_blocks == 2 + 40 // BS
    # A request without segment marks (or a stale replica) gets no credit.
    assert policy.choose(RouteRequest(ids), reps).matched_blocks == 2
    policy.index.mark_stale("a")
    assert policy.match("a", RequestHashes(req, policy.hasher, "sha256")) == 0
    policy.check_integrity()
