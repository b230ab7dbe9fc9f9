"""Disk tier: one file per block, surviving restarts (LMCache's local disk backend,
SGLang HiCache's file storage).

Layout under the user's directory (``<ns>`` is the 16-hex-digit namespace digest of model
fingerprint, dtype and shapes, ``block_format.py``; ``<h>`` the 32-hex-digit block hash)::

    PATH/kvstack-<ns>/<h[0:2]>/<h>.kvb

* **Write**: to ``<h>.kvb.tmp-<pid>`` then ``os.replace`` (atomic on POSIX), so a crash
  never leaves a half-written ``.kvb`` under a valid name.
* **Read**: the header and CRC-32 are checked (``block_format.decode``); a truncated or
  corrupted file is deleted, counted (``corrupt``) and treated as a miss.
* **Budget**: a byte budget with LRU or LFU eviction (``budget.py``); evicted files are
  unlinked.
* **Warm restart**: at start the namespace directory is scanned and every ``.kvb`` file
  enters the index, oldest modification time first (so LRU resumes roughly where it
  stopped); loads touch the file's mtime. A file written by another process after the
  scan is found on a lookup miss (the directory may be shared).
* **Full disk**: ``ENOSPC``/``EDQUOT``/``EROFS`` disables writes to this tier with one
  warning; reads continue.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstack.kv.tiers.base import OffloadTier
from kvstack.kv.tiers.block_format import BlockLayout, CorruptBlockError, decode, encode
from kvstack.kv.tiers.budget import BlockBudget

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


class DiskTier(OffloadTier):
    kind = "disk"

    def __init__(
        self, layout: BlockLayout, path: str | Path, capacity_bytes: int, policy: str = "lru"
    ) -> None:
        super().__init__(layout)
        self.root = Path(path) / f"kvstack-{layout.namespace.hex()}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = BlockBudget(capacity_bytes, policy)
        self.writes_disabled = False
        self._scan()

    def describe(self) -> str:
        cap = self.budget.capacity_bytes
        return (
            f"disk {self.root} ({cap / 2**30:.2f} GiB budget; {len(self.budget)} blocks "
            f"found from earlier runs)"
        )

    def _path(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.root / h[:2] / f"{h}.kvb"

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                if ".kvb.tmp-" in name:  # a write interrupted by a crash
                    Path(entry.path).unlink(missing_ok=True)
                    continue
                if not name.endswith(".kvb"):
                    continue
                try:
                    key = bytes.fromhex(name[:-4])
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            if key not in self.budget and self.budget.fits(size):
                for victim in self.budget.admit(key, size):
                    self._unlink(victim)
        self._sync_stats()

    def _sync_stats(self) -> None:
        self.stats.num_blocks = len(self.budget)
        self.stats.used_bytes = self.budget.used_bytes

    def _unlink(self, block_hash: bytes) -> None:
        self._path(block_hash).unlink(missing_ok=True)

    def _read(self, block_hash: bytes) -> bytes | None:
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.budget.remove(block_hash)
            return None
        except OSError as e:
            self.stats.errors += 1
            self.warn_once("read", "cannot read %s (%s); recomputing", path, e)
            return None
        try:
            payload = decode(self.layout, block_hash, data)
        except CorruptBlockError as e:
            self.stats.corrupt += 1
            self.warn_once("corrupt", "%s is corrupt (%s); deleted, recomputing", path, e)
            self.budget.remove(block_hash)
            path.unlink(missing_ok=True)
            return None
        if block_hash not in self.budget and self.budget.fits(len(data)):
            for victim in self.budget.admit(block_hash, len(data)):  # written by a peer
                self._unlink(victim)
        self.budget.hit(block_hash)
        try:
            os.utime(path)
        except OSError:
            self.stats.errors += 1
        return payload

    def lookup_load(self, hashes: Sequence[bytes]) -> list[bytes]:
        t0 = time.perf_counter()
        out: list[bytes] = []
        for h in hashes:
            payload = self._read(h)
            if payload is None:
                self.stats.misses += 1
                break
            out.append(payload)
        self._sync_stats()
        return self.stats.record_load(out, t0)

    def store(self, block_hash: bytes, payload: bytes) -> None:
        if block_hash in self.budget:
            return
        data = encode(self.layout, block_hash, payload)
        if self.writes_disabled or not self.budget.fits(len(data)):
            self.stats.dropped_stores += 1
            return
        path = self._path(block_hash)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.stats.errors += 1
            self.stats.dropped_stores += 1
            if e.errno in _FULL_ERRNOS:
                self.writes_disabled = True
                self.warn_once("full", "%s is full or read-only (%s); writes disabled", path, e)
            else:
                self.warn_once("write", "cannot write %s (%s)", path, e)
            return
        for victim in self.budget.admit(block_hash, len(data)):
            self._unlink(victim)
            self.stats.evictions += 1
        self.stats.stores += 1
        self.stats.bytes_stored += len(data)
        self._sync_stats()

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.budget

    def held_hashes(self) -> list[bytes] | None:
        return list(self.budget.sizes)

    def watch_evictions(self, callback: Callable[[list[bytes]], None]) -> None:
        self.budget.on_evict = callback

    def check_integrity(self) -> None:
        super().check_integrity()
        self.budget.check_integrity()
