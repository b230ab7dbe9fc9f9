"""Disk tier: one file per block, surviving restarts (LMCache's local disk backend,
SGLang HiCache's file storage).

Layout under the user's directory (``<ns>`` is the 16-hex-digit namespace digest of model
fingerprint, dtype and shapes, ``block_format.py``; ``<h>`` the 32-hex-digit block hash)::

    PATH/kvstack-<ns>/<h[0:2]>/<h>.kvb

* **Write**: to ``<h>.kvb.tmp-<pid>-<random>`` created with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` (mode 0600), then ``os.replace`` (atomic on POSIX), so a crash never leaves
  a half-written ``.kvb`` under a valid name, and a planted symlink is never followed: a
  predictable temp name opened with ``open(tmp, "wb")`` let one overwrite any file the
  server could write (a symlink attack).
* **No symlinks**: every file is opened relative to its subdirectory's descriptor, the
  subdirectory itself with ``O_NOFOLLOW | O_DIRECTORY``; a symlinked block file or
  subdirectory is an error (a miss), never followed. Directories are created 0700.
* **Read**: the header and CRC-32 are checked (``block_format.decode``); a truncated or
  corrupted file is deleted, counted (``corrupt``) and treated as a miss.
* **Budget**: a byte budget with LRU or LFU eviction (``budget.py``); evicted files are
  unlinked.
* **Warm restart**: at start the namespace directory is scanned and every ``.kvb`` file
  enters the index, oldest modification time first (so LRU resumes roughly where it
  stopped); loads touch the file's mtime. Temp files are deleted only when older than
  ``STALE_TMP_S`` (a crashed write; another live process may be writing a young one).
  A file written by another process after the scan is found on a lookup miss (the
  directory may be shared).
* **Full disk**: ``ENOSPC``/``EDQUOT``/``EROFS`` pauses writes to this tier with one
  warning; reads continue. After a back-off (``full_backoff_s``, doubling per failed
  re-check up to ``FULL_BACKOFF_MAX_S``) the next store re-checks: the index drops the
  blocks whose files are gone (an operator freeing space deletes them), ``statvfs`` must
  show room for the block, and a write that succeeds resumes storing (as the Redis tier
  retries after its back-off). Before, writes stayed off until a restart and the index
  kept listing deleted files, so ``stores`` stayed flat and those blocks were never
  stored again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstack.kv.tiers.base import OffloadTier
from kvstack.kv.tiers.block_format import BlockLayout, CorruptBlockError, decode, encode
from kvstack.kv.tiers.budget import BlockBudget

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
STALE_TMP_S = 3600.0  # a temp file this old is a crashed write, not a peer's live one
FULL_BACKOFF_S = 5.0  # first re-check of a full disk; doubles per failed re-check
FULL_BACKOFF_MAX_S = 300.0
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW


class DiskTier(OffloadTier):
    kind = "disk"

    def __init__(
        self,
        layout: BlockLayout,
        path: str | Path,
        capacity_bytes: int,
        policy: str = "lru",
        full_backoff_s: float = FULL_BACKOFF_S,
    ) -> None:
        super().__init__(layout)
        self.root = Path(path) / f"kvstack-{layout.namespace.hex()}"
        Path(path).mkdir(parents=True, exist_ok=True)
        self.root.mkdir(mode=0o700, exist_ok=True)
        if self.root.is_symlink():
            raise OSError(errno.ELOOP, f"{self.root} is a symlink")
        self.budget = BlockBudget(capacity_bytes, policy)
        self.full_backoff_s = full_backoff_s
        self._full_wait = full_backoff_s  # the current back-off while full
        self._full_until: float | None = None  # while full: when to re-check (monotonic)
        self._scan()

    @property
    def writes_disabled(self) -> bool:
        """True while a full disk pauses writes (until a re-check finds room)."""
        return self._full_until is not None

    def _may_write(self, size: int) -> bool:
        """False while paused by a full disk and before the back-off has passed; after
        it, drop the index entries whose files are gone and ask ``statvfs`` for room."""
        if self._full_until is None:
            return True
        if time.monotonic() < self._full_until:
            return False
        self._drop_missing()
        try:
            st = os.statvfs(self.root)
            room = st.f_bavail * st.f_frsize >= size
        except OSError:
            room = False
        if not room:
            self._paused()
        return room

    def _paused(self) -> None:
        """A full disk (again): back off, twice as long as last time when already paused."""
        if self._full_until is not None:
            self._full_wait = min(2 * self._full_wait, FULL_BACKOFF_MAX_S)
        self._full_until = time.monotonic() + self._full_wait

    def _drop_missing(self) -> None:
        """Forget the blocks whose files are gone (evicted, as the budget reports them)."""
        gone = [k for k in self.budget.sizes if not os.path.lexists(self._path(k))]
        for key in gone:
            self.budget.remove(key)
        if gone and self.budget.on_evict is not None:
            self.budget.on_evict(gone)
        self._sync_stats()

    def describe(self) -> str:
        cap = self.budget.capacity_bytes
        return (
            f"disk {self.root} ({cap / 2**30:.2f} GiB budget; {len(self.budget)} blocks "
            f"found from earlier runs)"
        )

    def _path(self, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.root / h[:2] / f"{h}.kvb"

    def _open_subdir(self, block_hash: bytes, create: bool) -> int:
        """A descriptor of the block's subdirectory, never through a symlink (ELOOP or
        ENOTDIR if it is one); created 0700 when ``create``."""
        sub = self.root / block_hash.hex()[:2]
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(sub, 0o700)
        return os.open(sub, _DIR_FLAGS)

    def _read_file(self, block_hash: bytes) -> bytes:
        name = self._path(block_hash).name
        dfd = self._open_subdir(block_hash, create=False)
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise OSError(errno.EINVAL, f"{name} is not a regular file")
                data = f.read()
            os.utime(name, dir_fd=dfd, follow_symlinks=False)
            return data
        finally:
            os.close(dfd)

    def _write_file(self, block_hash: bytes, data: bytes) -> None:
        name = self._path(block_hash).name
        tmp = f"{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}"
        dfd = self._open_subdir(block_hash, create=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600,
                         dir_fd=dfd)  # fmt: skip
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                os.unlink(tmp, dir_fd=dfd)
                raise
        finally:
            os.close(dfd)

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for sub in self.root.iterdir():
            if sub.is_symlink() or not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if ".kvb.tmp-" in name:  # a crashed write, unless young (a live peer's)
                    if now - st.st_mtime > STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                if not name.endswith(".kvb") or not stat.S_ISREG(st.st_mode):
                    continue
                try:
                    key = bytes.fromhex(name[:-4])
                except ValueError:
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
            data = self._read_file(block_hash)
        except FileNotFoundError:
            self.budget.remove(block_hash)
            return None
        except OSError as e:  # a symlink (ELOOP / ENOTDIR) included: never followed
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
        if not self.budget.fits(len(data)) or not self._may_write(len(data)):
            self.stats.dropped_stores += 1
            return
        path = self._path(block_hash)
        try:
            self._write_file(block_hash, data)
        except OSError as e:
            self.stats.errors += 1
            self.stats.dropped_stores += 1
            if e.errno in _FULL_ERRNOS:
                self._paused()
                self.warn_once("full", "%s is full or read-only (%s); writes disabled, "
                               "re-checked with back-off", path, e)  # fmt: skip
            else:
                self.warn_once("write", "cannot write %s (%s)", path, e)
            return
        if self._full_until is not None:
            self._full_until, self._full_wait = None, self.full_backoff_s
            self.clear_warning("full", f"{self.root} has room again; stores resumed")
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
