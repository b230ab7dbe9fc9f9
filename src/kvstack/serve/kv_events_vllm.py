"""kvstack's KV events as vLLM publishes them: ``KVEventBatch`` with vLLM's block hashes.

The wire schema (``vllm/distributed/kv_events.py``; msgpack, as msgspec encodes those
structs: the batch is an array, each event a map whose first key is ``type``)::

    KVEventBatch     = [ts: float64 (Unix seconds), events: [event, ...], data_parallel_rank: 0]
    BlockStored      = {"type": "BlockStored", "block_hashes": [bin, ...],
                        "parent_block_hash": bin | nil, "token_ids": [int, ...],
                        "block_size": int, "lora_id": nil, "medium": str, "lora_name": nil}
    BlockRemoved     = {"type": "BlockRemoved", "block_hashes": [bin, ...], "medium": str}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

``medium``: the engine's pool is vLLM's ``"GPU"`` (the primary KV pool, in RAM on this
CPU engine), the host tier ``"CPU"``, the disk and Redis tiers ``"STORAGE"``.

Hashes: with ``sha256`` / ``sha256_cbor`` each block's hash is vLLM's
(``kv/vllm_hashing.py``), computed from the event's token ids and the parent's vLLM hash;
the translator remembers kvstack hash -> vLLM hash for the blocks a medium holds, so a
``BlockRemoved`` (which carries hashes only) names the same ids. A prompt with a
``cache_salt`` is published with an opaque first-block key (the salt is not in the
event), so no indexer matches it: isolating it is what the salt is for. ``builtin``
publishes kvstack's own hashes unchanged. Not thread-safe: one publisher thread calls it.
"""

from __future__ import annotations

from typing import Any

from kvstack.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstack.kv.hashing import hash_block, root_hash
from kvstack.kv.vllm_hashing import HASH_FUNCTIONS, hash_block_tokens, none_hash

MEDIUMS = {"device": "GPU", "host": "CPU", "disk": "STORAGE", "redis": "STORAGE"}


class VllmEventTranslator:
    """kvstack ``KVEvent`` -> vLLM event maps (in vLLM's field order), or None to skip."""

    def __init__(self, algo: str, model_id: str = "") -> None:
        self.algo = algo
        self._fn = HASH_FUNCTIONS.get(algo)
        self._none = none_hash(self._fn) if self._fn is not None else b""
        self._root = root_hash(model_id, None)  # kvstack's unsalted root
        self._ext: dict[str, dict[bytes, bytes]] = {}  # medium -> kvstack hash -> vLLM's
        self.num_untranslatable = 0  # stored blocks whose parent chain was unknown

    def reset(self) -> None:
        """Forget every known hash (events were dropped: the publisher sends a clear)."""
        self._ext.clear()

    def translate(self, ev: KVEvent) -> dict[str, Any] | None:
        medium = MEDIUMS.get(ev.medium, ev.medium.upper())
        if isinstance(ev, AllBlocksCleared):
            return self._cleared(ev.medium, medium)
        if isinstance(ev, BlockRemoved):
            known = self._ext.get(ev.medium, {})
            hashes = [self._external(known.pop(h, None), h) for h in ev.block_hashes]
            kept = [h for h in hashes if h is not None]
            return (
                {"type": "BlockRemoved", "block_hashes": kept, "medium": medium} if kept else None
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
            {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium} if hashes else None
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
        return {
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": None,
            "medium": medium, "lora_name": None,
        }  # fmt: skip

    def _chain(self, ev: BlockStored) -> list[bytes] | None:
        assert self._fn is not None
        device = self._ext.setdefault("device", {})
        bs, ids = ev.block_size, ev.token_ids
        extra: tuple[Any, ...] | None = None
        if ev.parent_block_hash is None:
            parent = self._none
            if hash_block(self._root, ids[:bs]) != ev.block_hashes[0]:
                extra = ("kvstack-salted", ev.block_hashes[0].hex())  # salt unknown: opaque
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
