"""vLLM's prefix-cache block hashes (``vllm/v1/core/kv_cache_utils.py``), for KV events.

An external KV indexer (llm-d's, Dynamo's, ``kvstack router``'s) does not read the
engine's hashes as opaque ids only: it recomputes them from a prompt's token ids to ask
which replica holds the prefix. So the KV events kvstack publishes on vLLM's wire carry
vLLM's hashes, computed exactly as vLLM 0.32 computes them (``--prefix-caching-hash-algo``):

    NONE_HASH    = H(seed)       seed = $PYTHONHASHSEED if set, else "vllm-none-hash"
                                 (xxhash / xxhash_cbor: 32 random bytes per process)
    block_hash_i = H((parent, tuple(block_tokens_i), extra_keys_i))
                   parent = block_hash_{i-1}, NONE_HASH for the first block
                   extra_keys_0 = (("cache_salt", salt),) for a prompt with a non-empty
                   cache_salt; every other block (and an unsalted first block): None

``H`` is ``sha256`` (SHA-256 of a protocol-5 pickle: vLLM's default), ``sha256_cbor``
(SHA-256 of canonical CBOR: language-neutral, what a non-Python indexer implements),
``xxhash`` / ``xxhash_cbor`` (XXH3-128 of the same; needs the ``xxhash`` package).
vLLM's other extra keys (``("lora", name, path)``, ``("mm", id, offset)``,
``("prompt_embeds", digest)``) never occur: kvstack serves no LoRA, multimodal or
prompt-embeds request. What an indexer must share with the engines to match: the
algorithm, the block size, the seed (so: the same ``PYTHONHASHSEED`` or none on both,
and never an xxhash algorithm without it) and the request's ``cache_salt``.

kvstack's own chain (``kv/hashing.py``, BLAKE2b with the model id in the root) is
unchanged: tiers and the SSE stream keep using it; ``builtin`` publishes it as is.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cbor2

from kvstack.core.errors import ConfigError

#: vLLM 0.32's ``PrefixCachingHashAlgo`` choices, then kvstack's own chain.
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "builtin")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


def sha256(value: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of ``pickle.dumps(value, protocol=HIGHEST_PROTOCOL)``."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of ``cbor2.dumps(value, canonical=True)``."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash as xx
    except ImportError:
        raise ConfigError(
            "--prefix-caching-hash-algo xxhash needs the xxhash package (pip install xxhash)"
        ) from None
    return bytes(xx.xxh3_128_digest(data))


def xxhash(value: Any) -> bytes:
    """vLLM's ``xxhash``: XXH3-128 of the protocol-5 pickle."""
    return _xxh3_128(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(value: Any) -> bytes:
    """vLLM's ``xxhash_cbor``: XXH3-128 of canonical CBOR."""
    return _xxh3_128(cbor2.dumps(value, canonical=True))


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash, "xxhash_cbor": xxhash_cbor,
}  # fmt: skip


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The function of a vLLM algorithm (``ConfigError`` for ``builtin`` or an unknown one);
    an xxhash algorithm is tried once, so a missing package fails at startup."""
    fn = HASH_FUNCTIONS.get(algo)
    if fn is None:
        raise ConfigError(
            f"--prefix-caching-hash-algo {algo!r} is not one of vLLM's: {', '.join(HASH_FUNCTIONS)}"
        )
    fn(b"")
    return fn


@functools.cache
def _random_seed() -> str:
    return os.urandom(32).hex()


def none_hash_seed(algo: str) -> str:
    """vLLM's ``resolve_none_hash_seed``: $PYTHONHASHSEED wins; else the fixed seed for the
    SHA-256 algorithms and a per-process random one for xxhash (so no other process, and
    no indexer, can reproduce xxhash hashes unless PYTHONHASHSEED is set)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    return _random_seed() if algo in NON_CRYPTO_ALGOS else DEFAULT_NONE_HASH_SEED


def none_hash(fn: Callable[[Any], bytes], algo: str = "sha256") -> bytes:
    """The parent of every first block: ``fn(none_hash_seed(algo))``."""
    return fn(none_hash_seed(algo))


def salt_extra_keys(cache_salt: str | None) -> tuple[Any, ...] | None:
    """The first block's extra keys for a salt (vLLM 0.32 tags it; an empty salt is none)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


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
    fn = hash_function(algo)
    parent, out = none_hash(fn, algo), []
    for b in range(len(token_ids) // block_size):
        extra = salt_extra_keys(cache_salt) if b == 0 else None
        parent = hash_block_tokens(
            fn, parent, token_ids[b * block_size : (b + 1) * block_size], extra
        )
        out.append(parent)
    return out
