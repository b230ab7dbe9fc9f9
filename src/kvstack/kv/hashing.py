"""Chained block hashes for prefix reuse (vLLM v1 ``kv_cache_utils.hash_block_tokens``).

A full block's hash covers its parent's hash, its own token ids and the extra keys
(model id, a per-request cache salt), so equal hashes mean equal *prefixes*, not
just equal blocks::

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t47][t48 t49]
    hashes:   h0         h1          h2          (partial block: no hash)
    h0 = H(root, t0..t15)   h1 = H(h0, t16..t31)   h2 = H(h1, t32..t47)
    root = H("kvstack", model id, salt)

``H`` is BLAKE2b with a 128-bit digest. A collision would return another prefix's
KV, so the digest is wide enough that one is not expected in the lifetime of the
universe of caches (2^64 blocks for a 50 % chance by the birthday bound); Python's
``hash()`` (64 bit, salted per process) would be neither wide nor stable enough for
the disk and Redis tiers.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = bytes
DIGEST_SIZE = 16


def root_hash(model_id: str = "", salt: str | None = None) -> BlockHash:
    """Parent hash of the first block of every sequence with these extra keys."""
    h = blake2b(digest_size=DIGEST_SIZE, person=b"kvstack-root")
    h.update(model_id.encode())
    h.update(b"\x00")
    if salt is not None:
        h.update(b"salt:" + salt.encode())
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash."""
    h = blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash,
    prev: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of the *full* blocks of ``token_ids`` after the ``len(prev)`` already hashed.

    ``prev`` holds the hashes of the first blocks (so the chain can be extended
    incrementally as a sequence grows); ``parent`` is the root hash.
    """
    out: list[BlockHash] = []
    last = prev[-1] if prev else parent
    for b in range(len(prev), len(token_ids) // block_size):
        last = hash_block(last, token_ids[b * block_size : (b + 1) * block_size])
        out.append(last)
    return out
