"""Redis tier: blocks shared by every replica pointed at one Redis (LMCache's remote
backend, Mooncake Store / Dynamo's shared tier, in miniature).

* **Keys** ``kvstack:<ns>:<h>``: ``<ns>`` is the namespace digest (model fingerprint,
  dtype, block size, shapes) and ``<h>`` the block's prefix hash chain, so two replicas
  of one model share keys and another model or dtype never sees them.
* **Values** the block in ``block_format`` (header + CRC-32 + K/V bytes in the cache
  dtype); a value that fails its test is deleted and counts as a miss.
* **Limits**: each value is written with ``SET ... EX ttl`` (default 24 h, ``?ttl=``).
  The total size is Redis's ``maxmemory`` with ``maxmemory-policy allkeys-lru`` (set by
  the operator; ``scripts/redis.sh`` starts test servers that way), so Redis itself
  evicts the least recently used blocks.
* **Faults**: every call has a socket timeout (default 0.25 s, ``?timeout=``) and no
  retries. The first failure logs one warning, increments ``errors`` and opens a circuit
  for ``backoff`` seconds (default 5, ``?backoff=``) during which lookups miss and stores
  are dropped, so a dead Redis costs each request nothing but a recompute. The next call
  after the backoff tries again; success logs that the tier recovered. A restarted Redis
  simply starts empty.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstack.kv.tiers.base import OffloadTier
from kvstack.kv.tiers.block_format import BlockLayout, CorruptBlockError, decode, encode
from kvstack.kv.tiers.redis_url import redacted, redis_client_url

MGET_CHUNK = 32  # keys per round trip when walking a prefix
_KNOWN_MAX = 1 << 16  # hashes remembered as already stored (skips re-uploads)


class RedisTier(OffloadTier):
    kind = "redis"

    def __init__(
        self,
        layout: BlockLayout,
        url: str,
        ttl_s: int = 86400,
        timeout_s: float = 0.25,
        backoff_s: float = 5.0,
    ) -> None:
        super().__init__(layout)
        # What logs and describe() show: never the password (a log line is no place for it).
        self.url = redacted(url).split("?")[0]
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        # redis-py reads the URL: redis:// rediss:// (TLS) unix://, ACL user and password.
        self.client = redis.Redis.from_url(
            redis_client_url(url),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self.prefix = f"kvstack:{layout.namespace.hex()}:".encode()
        self._down_until = 0.0
        # hash -> when we stored it; trusted for half the TTL, so an expired block is
        # written again rather than believed present.
        self._known: OrderedDict[bytes, float] = OrderedDict()

    def describe(self) -> str:
        return f"redis {self.url} (ttl {self.ttl_s}s)"

    def _key(self, block_hash: bytes) -> bytes:
        return self.prefix + block_hash.hex().encode()

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.backoff_s
        self._known.clear()  # a restarted Redis has lost what we stored
        self.warn_once(
            "down",
            "%s unavailable (%s: %s); serving by recomputing, retrying every %.0fs",
            self.url,
            type(exc).__name__,
            exc,
            self.backoff_s,
        )

    def _ok(self) -> None:
        self.clear_warning("down", f"{self.url} is reachable again")

    def lookup_load(self, hashes: Sequence[bytes]) -> list[bytes]:
        if not hashes or not self._available():
            return []
        t0 = time.perf_counter()
        out: list[bytes] = []
        try:
            for start in range(0, len(hashes), MGET_CHUNK):
                chunk = hashes[start : start + MGET_CHUNK]
                values = self.client.mget([self._key(h) for h in chunk])
                for h, value in zip(chunk, values, strict=True):
                    payload = self._check(h, value)
                    if payload is None:
                        self.stats.misses += 1
                        return self.stats.record_load(out, t0)
                    out.append(payload)
        except (redis.RedisError, OSError) as e:
            self._failed(e)
            return []
        self._ok()
        return self.stats.record_load(out, t0)

    def _check(self, block_hash: bytes, value: object) -> bytes | None:
        if not isinstance(value, bytes):
            return None
        try:
            return decode(self.layout, block_hash, value)
        except CorruptBlockError as e:
            self.stats.corrupt += 1
            self.warn_once("corrupt", "value of %s is corrupt (%s); deleted", block_hash.hex(), e)
            self.client.delete(self._key(block_hash))
            return None

    def store(self, block_hash: bytes, payload: bytes) -> None:
        if self.contains(block_hash):
            return
        if not self._available():
            self.stats.dropped_stores += 1
            return
        data = encode(self.layout, block_hash, payload)
        try:
            self.client.set(self._key(block_hash), data, ex=self.ttl_s)
        except (redis.RedisError, OSError) as e:
            self.stats.dropped_stores += 1
            self._failed(e)
            return
        self._ok()
        self._known[block_hash] = time.monotonic()
        self._known.move_to_end(block_hash)
        if len(self._known) > _KNOWN_MAX:
            self._known.popitem(last=False)
        self.stats.stores += 1
        self.stats.bytes_stored += len(data)
        self.stats.num_blocks = len(self._known)

    def contains(self, block_hash: bytes) -> bool:
        stored = self._known.get(block_hash)
        return stored is not None and time.monotonic() - stored < self.ttl_s / 2

    def close(self) -> None:
        super().close()
        self.client.close()
