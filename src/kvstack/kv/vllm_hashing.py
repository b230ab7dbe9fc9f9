"""vLLM's prefix-cache block hashes (``vllm/v1/core/kv_cache_utils.py``), for KV events.

An external KV indexer (llm-d's, Dynamo's) does not read the engine's hashes as opaque
ids only: it recomputes them from a prompt's token ids to ask which replica holds the
prefix. So the KV events kvstack publishes on vLLM's wire carry vLLM's hashes, computed
exactly as vLLM computes them (``--prefix-caching-hash-algo``):

    NONE_HASH    = H(seed)                 seed = $PYTHONHASHSEED or "vllm-none-hash"
    block_hash_i = H((parent, tuple(block_tokens_i), extra_keys_i))
                   parent = block_hash_{i-1}, NONE_HASH for the first block
                   extra_keys_0 = (cache_salt,) for a salted prompt, else None

``H`` is ``sha256_cbor`` (SHA-256 of canonical CBOR: language-neutral, what a non-Python
indexer implements) or ``sha256`` (SHA-256 of a protocol-5 pickle: vLLM's default).
kvstack's own chain (``kv/hashing.py``, BLAKE2b with the model id in the root) is
unchanged: tiers and ``kvstack router`` keep using it; ``builtin`` publishes it as is.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

HASH_ALGOS = ("sha256", "sha256_cbor", "builtin")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256(value: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of ``pickle.dumps(value, protocol=HIGHEST_PROTOCOL)``."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of ``cbor2.dumps(value, canonical=True)``."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": sha256, "sha256_cbor": sha256_cbor}


def none_hash(fn: Callable[[Any], bytes]) -> bytes:
    """The parent of every first block: ``fn`` of $PYTHONHASHSEED or vLLM's fixed seed."""
    return fn(os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED))


def hash_block_tokens(
    fn: Callable[[Any], bytes],
    parent: bytes,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """One block's hash given its parent's (``NONE_HASH`` for the first block)."""
    return fn((parent, tuple(token_ids), extra_keys))


def hash_prompt(
    algo: str, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """vLLM's hashes of every full block of ``token_ids`` (what an indexer computes)."""
    fn = HASH_FUNCTIONS[algo]
    parent, out = none_hash(fn), []
    for b in range(len(token_ids) // block_size):
        extra = (cache_salt,) if b == 0 and cache_salt is not None else None
        parent = hash_block_tokens(
            fn, parent, token_ids[b * block_size : (b + 1) * block_size], extra
        )
        out.append(parent)
    return out
