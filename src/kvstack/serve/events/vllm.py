"""kvstack's KV events as vLLM publishes them: ``KVEventBatch`` with vLLM's block hashes.

The wire schema (``vllm/distributed/kv_events.py`` of vLLM 0.32; msgpack, as msgspec
encodes those structs with ``omit_defaults``: the batch is an array, each event a map
whose first key is ``type``, fields in declaration order, fields at their default left
out)::

    KVEventBatch     = [ts: float64 (Unix seconds), events: [event, ...], data_parallel_rank: 0]
    BlockStored      = {"type": "BlockStored", "block_hashes": [uint64 | bin, ...],
                        "parent_block_hash": uint64 | bin | nil, "token_ids": [int, ...],
                        "block_size": int, "lora_id": nil, "medium": str, "lora_name": nil,
                        "extra_keys": [[salt] | nil, ...], "group_idx": 0}
    BlockRemoved     = {"type": "BlockRemoved", "block_hashes": [uint64 | bin, ...], "medium": str,
                        "group_idx": 0}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

``extra_keys`` has one entry per block, untagged as vLLM publishes them
(``to_event_extra_keys``): ``[salt]`` for the first block of a salted prompt, nil
otherwise. vLLM's other optional fields (``kv_cache_spec_*``, ``locality``,
``ownership``, ``session_id``) stay at their default and are omitted, as vLLM omits them.

Block hashes go out as vLLM 0.32 sends them by default: the low 64 bits of the hash as
an unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default, what llm-d's
indexer keys by); with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` the whole hash as bytes.

``medium``: the engine's pool is vLLM's ``"GPU"`` (the primary KV pool, in RAM on this
CPU engine), the host tier ``"CPU"``, the disk and Redis tiers ``"STORAGE"``.

Hashes: with a vLLM algorithm each block's hash is vLLM's (``kv/vllm_hashing.py``),
computed from the event's token ids, the parent's vLLM hash and, for a run that starts
a salted sequence, the salt as vLLM's first-block extra key; the translator remembers
kvstack hash -> vLLM hash for the blocks a medium holds, so a ``BlockRemoved`` (which
carries hashes only) names the same ids. ``builtin`` publishes kvstack's own hashes
unchanged. Not thread-safe: one publisher thread calls it.
"""

from __future__ import annotations

import os
from typing import Any

from kvstack.core.errors import ConfigError
from kvstack.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    SegmentRemoved,
    SegmentStored,
)
from kvstack.kv.vllm_hashing import hash_block_tokens, hash_function, none_hash, salt_extra_keys

INT_HASH_MASK = (1 << 64) - 1
MEDIUMS = {"device": "GPU", "host": "CPU", "disk": "STORAGE", "redis": "STORAGE"}


class VllmEventTranslator:
    """kvstack ``KVEvent`` -> vLLM event maps (in vLLM's field order), or None to skip."""

    def __init__(self, algo: str, int_hashes: bool = False) -> None:
        self.algo = algo
        self.int_hashes = int_hashes
        self._fn = None if algo == "builtin" else hash_function(algo)
        self._none = none_hash(self._fn, algo) if self._fn is not None else b""
        self._ext: dict[str, dict[bytes, bytes]] = {}  # medium -> kvstack hash -> vLLM's
        self.num_untranslatable = 0  # stored blocks whose parent chain was unknown

    def reset(self) -> None:
        """Forget every known hash (events were dropped: the publisher sends a clear)."""
        self._ext.clear()

    def translate(self, ev: KVEvent) -> dict[str, Any] | None:
        out = self._translate(ev)
        if out is not None and self.int_hashes:
            out["block_hashes"] = [_as_int(h) for h in out["block_hashes"]]
            if out.get("parent_block_hash") is not None:
                out["parent_block_hash"] = _as_int(out["parent_block_hash"])
        return out

    def _translate(self, ev: KVEvent) -> dict[str, Any] | None:
        if isinstance(ev, SegmentStored | SegmentRemoved):
            return None  # kvstack's own (segment reuse): vLLM's wire has no segments
        medium = MEDIUMS.get(ev.medium, ev.medium.upper())
        if isinstance(ev, AllBlocksCleared):
            return self._cleared(ev.medium, medium)
        if isinstance(ev, BlockRemoved):
            known = self._ext.get(ev.medium, {})
            hashes = [self._external(known.pop(h, None), h) for h in ev.block_hashes]
            kept = [h for h in hashes if h is not None]
            return (
                {"type": "BlockRemoved", "block_hashes": kept, "medium": medium, "group_idx": 0}
                if kept
                else None
            )
        return self._stored(ev, medium)

    def _external(self, ext: bytes | None, h: bytes) -> bytes | None:
        return h if self._fn is None else ext

    def _cleared(self, medium_key: str, medium: str) -> dict[str, Any] | None:
        held = self._ext.pop(medium_key, {})
        if medium_key == "device":
            return {"type": "AllBlocksCleared"}
        # vLLM's AllBlocksCleared means every medium: a tier's reset is its removals.
        hashes = list(held.values())
        return (
            {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}
            if hashes
            else None
        )

    def _stored(self, ev: BlockStored, medium: str) -> dict[str, Any] | None:
        mine = self._ext.setdefault(ev.medium, {})
        hashes: list[bytes] | None
        parent: bytes | None
        if self._fn is None:  # builtin: kvstack's hashes as they are
            hashes, parent = list(ev.block_hashes), ev.parent_block_hash
            mine.update((h, h) for h in hashes)
        elif ev.token_ids:  # the device pool: recompute the chain as vLLM does
            hashes, parent = self._chain(ev), None
            if hashes is None:
                self.num_untranslatable += 1
                return None
            if ev.parent_block_hash is not None:
                parent = self._ext["device"][ev.parent_block_hash]
        else:  # a tier stored blocks the device computed: their vLLM hashes are known
            device = self._ext.get("device", {})
            pairs = [(h, device[h]) for h in ev.block_hashes if h in device]
            mine.update(pairs)
            hashes, parent = [e for _, e in pairs], None
            if not hashes:
                return None
        assert hashes is not None
        salt = ev.cache_salt if ev.parent_block_hash is None and ev.cache_salt else None
        extra: list[list[str] | None] = [None] * len(hashes)
        if salt is not None and ev.token_ids:
            extra[0] = [salt]
        return {
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": None,
            "medium": medium, "lora_name": None, "extra_keys": extra, "group_idx": 0,
        }  # fmt: skip

    def _chain(self, ev: BlockStored) -> list[bytes] | None:
        assert self._fn is not None
        device = self._ext.setdefault("device", {})
        bs, ids = ev.block_size, ev.token_ids
        extra: tuple[Any, ...] | None = None
        if ev.parent_block_hash is None:
            parent = self._none
            extra = salt_extra_keys(ev.cache_salt)  # vLLM: the salt keys the first block
        elif ev.parent_block_hash in device:
            parent = device[ev.parent_block_hash]
        else:
            return None
        out = []
        for i, h in enumerate(ev.block_hashes):
            parent = hash_block_tokens(
                self._fn, parent, ids[i * bs : (i + 1) * bs], extra if i == 0 else None
            )
            device[h] = parent
            out.append(parent)
        return out


def _as_int(h: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits of the big-endian integer."""
    return int.from_bytes(h, "big") & INT_HASH_MASK


def int_block_hashes_from_env() -> bool:
    """``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` as vLLM reads it (unset: 1, ints)."""
    raw = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    try:
        return bool(int(raw))
    except ValueError:
        raise ConfigError(
            f"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES must be 0 or 1, got {raw!r}"
        ) from None
