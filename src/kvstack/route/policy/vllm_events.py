"""vLLM's ``KVEventBatch`` msgpack payload, decoded into typed records for the router.

The schema is ``vllm/distributed/kv_events.py`` (vLLM 0.32) as msgspec encodes it: the
batch is ``array_like`` (``[ts, events, data_parallel_rank]``, the rank omitted when
None), each event a tagged struct (``tag=True``): a map whose ``type`` key names the
class, fields at their default omitted (``omit_defaults``)::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
     [...], "block_size": 16, "lora_id": nil, "medium": "GPU", "lora_name": nil,
     "extra_keys": [...], "group_idx": 0, ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

Releases before the tagged maps encoded events ``array_like`` too (``["BlockStored",
hashes, parent, token_ids, block_size, lora_id, medium]``, the form llm-d's indexer
reads); both are accepted. A hash is ``bytes`` (vLLM's default) or an ``int`` (the low
64 bits, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); the router keys ints as 8 bytes
big-endian (``int_key``), so both compare as ``bytes``. Fields the router does not use
(``extra_keys``, ``lora_*``, ``session_id``...) are ignored; a missing or mistyped
field it uses is a ``MalformedBatchError``, never an exception of another kind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

INT_HASH_MASK = (1 << 64) - 1


class MalformedBatchError(ValueError):
    """A payload that is not a ``KVEventBatch`` as vLLM encodes it."""


def int_key(value: int) -> bytes:
    """An int block hash as the router keys it: its low 64 bits, 8 bytes big-endian."""
    return (value & INT_HASH_MASK).to_bytes(8, "big")


@dataclass(frozen=True)
class VllmStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    block_size: int
    medium: str
    int_hashes: bool  # the publisher sent ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    group_idx: int = 0


@dataclass(frozen=True)
class VllmRemoved:
    block_hashes: list[bytes]
    medium: str
    group_idx: int = 0


@dataclass(frozen=True)
class VllmCleared:
    """vLLM's ``AllBlocksCleared``: every medium of the publisher was reset."""


VllmEvent = VllmStored | VllmRemoved | VllmCleared


@dataclass(frozen=True)
class VllmBatch:
    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None


# Positional fields of the array_like event encoding, after the tag.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip


def decode_batch(payload: bytes) -> VllmBatch:
    """The batch of one PUB (or replay) payload; ``MalformedBatchError`` if it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MalformedBatchError(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise MalformedBatchError("a KVEventBatch is an array [ts, events, dp_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise MalformedBatchError("KVEventBatch: ts must be a number and events an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise MalformedBatchError(f"KVEventBatch: data_parallel_rank {rank!r}")
    return VllmBatch(float(ts), [_event(e) for e in events], rank)


def _event(raw: Any) -> VllmEvent:
    fields = _fields(raw)
    kind = fields.get("type")
    if kind == "AllBlocksCleared":
        return VllmCleared()
    medium = fields.get("medium") or "GPU"  # None: vLLM's unspecified, the GPU pool
    if not isinstance(medium, str):
        raise MalformedBatchError(f"{kind}: medium {medium!r}")
    group = fields.get("group_idx") or 0
    if not isinstance(group, int):
        raise MalformedBatchError(f"{kind}: group_idx {group!r}")
    hashes, ints = _hashes(kind, fields.get("block_hashes"))
    if kind == "BlockRemoved":
        return VllmRemoved(hashes, medium, group)
    bs = fields.get("block_size")
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise MalformedBatchError(f"BlockStored: block_size {bs!r}")
    parent_raw = fields.get("parent_block_hash")
    parent = None if parent_raw is None else _hashes(kind, [parent_raw])[0][0]
    return VllmStored(hashes, parent, bs, medium, ints, group)


def _fields(raw: Any) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        return raw
    if isinstance(raw, list) and raw and raw[0] in _ARRAY_FIELDS:
        names = _ARRAY_FIELDS[raw[0]]
        if len(raw) - 1 > len(names):
            raise MalformedBatchError(f"{raw[0]}: {len(raw) - 1} fields, at most {len(names)}")
        return {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    if isinstance(raw, list) and raw:
        raise MalformedBatchError(f"unknown event type {raw[0]!r}")
    raise MalformedBatchError(f"an event is a map or a tagged array, got {type(raw).__name__}")


def _hashes(kind: Any, raw: Any) -> tuple[list[bytes], bool]:
    if kind not in ("BlockStored", "BlockRemoved"):
        raise MalformedBatchError(f"unknown event type {kind!r}")
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise MalformedBatchError(f"{kind}: block_hashes {raw!r} is not an array")
    out, ints = [], False
    for h in raw:
        if isinstance(h, bytes):
            out.append(h)
        elif isinstance(h, int) and not isinstance(h, bool):
            out.append(int_key(h))
            ints = True
        else:
            raise MalformedBatchError(f"{kind}: block hash {h!r} is neither bytes nor int")
    return out, ints
