"""How one KV block is written outside the device pool (disk files, Redis values).

A block's payload is the block's slice of every tensor of the device pool, in order
(``KVStorage.block_tensors``), exactly its bytes. Without a codec that is::

    payload = K[layer 0..L-1, slot 0..bs-1, kv_head, head_dim] ++ V[same shape]

and with one (KV compression) the codec's codes and scales, so tiers hold compressed blocks too.

Around it, a fixed header makes every stored block self-describing, so a file or value
that belongs to another model, dtype, block size or prefix can never be loaded::

    offset  size  field
    0       4     magic  b"KVSB"
    4       2     format version (little endian)
    6       2     flags: bit 0 = an HMAC-SHA256 tag follows the payload
    8       8     namespace digest (model fingerprint, dtype, block size, shape)
    16      16    block hash (the prefix hash chain, ``kv/hashing.py``)
    32      8     payload length in bytes
    40      4     CRC-32 of the payload
    44      ...   payload
    44+n    32    HMAC-SHA256(key, header + payload), only with a key (flag bit 0)

``decode`` checks all of it; a truncated or flipped file raises ``CorruptBlockError``
(CRC-32 misses a random corruption with probability 2^-32; the block hash and namespace
in the header guard against a file under the wrong name). A CRC is not a MAC: whoever
can write the tier can forge one. With ``BlockLayout.auth_key`` (``--kv-offload-key-file``)
every block carries the HMAC tag and a block without a valid one is refused, so only a
holder of the key can inject KV; the key's id (a digest, never the key) is part of the
namespace, so blocks of another key are not even looked up (SECURITY.md).
"""

from __future__ import annotations

import hmac
import struct
import zlib
from dataclasses import dataclass, field
from hashlib import blake2b, sha256

MAGIC = b"KVSB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHH8s16sQI")
HEADER_SIZE = _HEADER.size
TAG_SIZE = 32  # HMAC-SHA256
FLAG_HMAC = 1
MIN_KEY_BYTES = 16


class CorruptBlockError(ValueError):
    """A stored block failed its header or checksum test; it must be recomputed."""


@dataclass(frozen=True)
class BlockLayout:
    """What must match for stored KV to be loadable: model, dtype and shapes.

    ``model_fingerprint`` identifies the weights (``model/loader/fingerprint.py``), not only
    the model's name, so two fine-tunes with one name never share KV.
    """

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    codec: str = "auto"  # KV codec: payloads are its codes and scales
    codec_bytes: int = 0  # bytes of one block in the codec's tensors (0: plain K/V)
    # KV groups (hybrid KV manager): the payload is every group's page in turn, each
    # its layers in slot order (``KVGroups.signature``); "" = layers 0..L-1 in order.
    kv_groups: str = ""
    # The tier secret (--kv-offload-key-file): blocks are signed and checked with it.
    auth_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.auth_key is not None and len(self.auth_key) < MIN_KEY_BYTES:
            raise ValueError(f"the tier key must have at least {MIN_KEY_BYTES} bytes")

    @property
    def payload_bytes(self) -> int:
        if self.codec_bytes:
            return self.codec_bytes
        kv = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return kv * self.itemsize

    @property
    def namespace(self) -> bytes:
        """8-byte digest of every field: the key prefix of disk and Redis entries."""
        text = "|".join(
            str(x)
            for x in (
                FORMAT_VERSION,
                self.model_fingerprint,
                self.dtype,
                self.block_size,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.itemsize,
                self.codec,
                self.codec_bytes,
                *([] if self.auth_key is None else ["hmac", _key_id(self.auth_key)]),
                *([] if not self.kv_groups else ["groups", self.kv_groups]),
            )
        )
        return blake2b(text.encode(), digest_size=8, person=b"kvstack-tier").digest()


def _key_id(key: bytes) -> str:
    return blake2b(key, digest_size=8, person=b"kvstack-keyid").hexdigest()


def _tag(key: bytes, header_and_payload: bytes) -> bytes:
    return hmac.new(key, header_and_payload, sha256).digest()


def encode(layout: BlockLayout, block_hash: bytes, payload: bytes) -> bytes:
    if len(payload) != layout.payload_bytes:
        raise ValueError(f"payload is {len(payload)} B, layout says {layout.payload_bytes} B")
    key = layout.auth_key
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        0 if key is None else FLAG_HMAC,
        layout.namespace,
        block_hash,
        len(payload),
        zlib.crc32(payload),
    )
    return header + payload if key is None else header + payload + _tag(key, header + payload)


def decode(layout: BlockLayout, block_hash: bytes, data: bytes) -> bytes:
    """The payload of ``data`` if it is a sound block ``block_hash`` of ``layout``."""
    if len(data) < HEADER_SIZE:
        raise CorruptBlockError(f"{len(data)} B is shorter than the {HEADER_SIZE} B header")
    magic, version, flags, ns, h, n, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptBlockError(f"bad magic/version {magic!r}/{version}")
    key = layout.auth_key
    if flags != (0 if key is None else FLAG_HMAC):
        raise CorruptBlockError("block is not signed with this tier's key" if key else
                                "block is signed, but this tier has no key")  # fmt: skip
    tag_size = 0 if key is None else TAG_SIZE
    if ns != layout.namespace:
        raise CorruptBlockError("block belongs to another model, dtype or block size")
    if h != block_hash:
        raise CorruptBlockError("block is stored under another prefix hash")
    if n != layout.payload_bytes or len(data) - HEADER_SIZE - tag_size != n:
        raise CorruptBlockError(
            f"payload is {len(data) - HEADER_SIZE - tag_size} B, header says {n} B, layout "
            f"{layout.payload_bytes} B (truncated?)"
        )
    payload = data[HEADER_SIZE : HEADER_SIZE + n]
    if key is not None and not hmac.compare_digest(
        _tag(key, data[: HEADER_SIZE + n]), data[HEADER_SIZE + n :]
    ):
        raise CorruptBlockError("HMAC tag mismatch: not written with this tier's key")
    if zlib.crc32(payload) != crc:
        raise CorruptBlockError("payload checksum mismatch")
    return payload
