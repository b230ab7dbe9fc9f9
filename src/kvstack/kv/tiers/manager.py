"""OffloadManager: the tiers and the one I/O thread that talks to them.

The engine thread never waits on a disk or a socket. It submits

* **loads** (``submit_load``) when a request arrives: the block hashes after its device
  prefix. The thread walks the tiers in order (a waterfall: tier 0 from the first hash,
  tier 1 from where tier 0 stopped, ...), so the result is the longest run of blocks
  found anywhere; blocks found in a lower tier are also stored into the tiers above it
  (promotion). The result is *staged* (payloads joined into one tensor) until the
  scheduler admits the request; meanwhile the scheduler skips that request (vLLM v1's
  ``WAITING_FOR_REMOTE_KVS``) and keeps serving the others.
* **stores** (``submit_store``) after each step: copies of the blocks that step made
  reusable (write-through, as vLLM's offloading connector and LMCache store what was
  computed). Queued stores are bounded in bytes; past the bound a store is dropped and
  counted, never blocking the engine.

Loads go before stores. ``flush`` waits until every queued store is written (tests,
shutdown: a graceful stop persists what it computed, so a restart finds it).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstack.kv.events import BlockRemoved, BlockStored, KVEventLog
from kvstack.kv.tiers.base import OffloadTier, TierStats
from kvstack.kv.tiers.block_format import BlockLayout

logger = logging.getLogger("kvstack.kv.tiers")

DEFAULT_MAX_PENDING_STORE_BYTES = 256 * 2**20


@dataclass
class StagedLoad:
    """Blocks ``start .. start + n`` of a request, found in the tiers."""

    start: int
    # One uint8 tensor per block: a zero-copy view of its payload bytes (joining 40 MB of
    # payloads into one fresh tensor cost more page faults than the load itself).
    blocks: list[torch.Tensor] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)  # tier name per block

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)


@dataclass
class _StoreJob:
    hashes: list[bytes]
    data: torch.Tensor  # [n, payload bytes] uint8

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _publish_removed(events: KVEventLog, medium: str) -> Callable[[list[bytes]], None]:
    return lambda hashes: events.publish(BlockRemoved(hashes, medium))


class OffloadManager:
    def __init__(
        self,
        tiers: Sequence[OffloadTier],
        layout: BlockLayout,
        max_pending_store_bytes: int = DEFAULT_MAX_PENDING_STORE_BYTES,
        events: KVEventLog | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("an OffloadManager needs at least one tier")
        self.tiers = list(tiers)
        # KV events with the tier as ``medium`` (published from the I/O thread): what each
        # store put into a tier, and what a tier's budget evicted for it.
        self.events = events
        if events is not None:
            for t in self.tiers:
                t.watch_evictions(_publish_removed(events, t.name))
        self.layout = layout
        self.max_pending_store_bytes = max_pending_store_bytes
        self._cv = threading.Condition()
        self._loads: deque[tuple[str, int, list[bytes]]] = deque()
        self._stores: deque[_StoreJob] = deque()
        self._store_bytes = 0
        self._loading: set[str] = set()  # submitted, not yet staged
        self._staged: dict[str, StagedLoad] = {}
        self._busy = False
        self._closed = False
        self.load_done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstack-offload", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def submit_load(self, request_id: str, start: int, hashes: list[bytes]) -> None:
        with self._cv:
            self._loading.add(request_id)
            self._loads.append((request_id, start, hashes))
            self._cv.notify()

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._loading)

    def take(self, request_id: str) -> StagedLoad | None:
        """The staged blocks of a request whose load finished (once), else None."""
        with self._cv:
            return self._staged.pop(request_id, None)

    def restage(self, request_id: str, staged: StagedLoad) -> None:
        """Put back what ``take`` returned (no room to load it yet)."""
        with self._cv:
            self._staged[request_id] = staged

    def cancel(self, request_id: str) -> None:
        """Forget a request's load (finished or aborted before admission)."""
        with self._cv:
            self._loading.discard(request_id)
            self._staged.pop(request_id, None)

    def all_contain(self, block_hash: bytes) -> bool:
        return all(t.contains(block_hash) for t in self.tiers)

    def submit_store(self, hashes: list[bytes], data: torch.Tensor) -> bool:
        job = _StoreJob(hashes, data)
        with self._cv:
            if self._closed or self._store_bytes + job.nbytes > self.max_pending_store_bytes:
                for t in self.tiers:
                    t.stats.dropped_stores += len(hashes)
                return False
            self._stores.append(job)
            self._store_bytes += job.nbytes
            self._cv.notify()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted store and load is done; False on timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not (self._stores or self._loads or self._busy), timeout
            )

    def close(self, flush_timeout: float = 30.0) -> None:
        if self._closed:
            return
        if not self.flush(flush_timeout):
            logger.warning("KV offload: stores still queued after %.0fs; dropped", flush_timeout)
        with self._cv:
            self._closed = True
            self._stores.clear()
            self._cv.notify_all()
        self._thread.join(timeout=5)
        for t in self.tiers:
            t.close()

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats.snapshot() for t in self.tiers}

    def check_integrity(self) -> None:
        assert self._store_bytes >= 0
        assert not (self._loading & set(self._staged)), "a request both loading and staged"
        for t in self.tiers:
            t.check_integrity()

    # ------------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._loads or self._stores or self._closed)
                if self._loads:
                    load, store = self._loads.popleft(), None
                elif self._stores:
                    load, store = None, self._stores.popleft()
                else:
                    return
                self._busy = True
            try:
                if load is not None:
                    self._do_load(*load)
                elif store is not None:
                    self._do_store(store)
            except Exception:  # a tier bug must not kill the thread: count and go on
                logger.exception("KV offload I/O failed")
                if load is not None:
                    self._finish_load(load[0], StagedLoad(load[1]))
            finally:
                with self._cv:
                    if store is not None:
                        self._store_bytes -= store.nbytes
                    self._busy = False
                    self._cv.notify_all()

    def _do_load(self, request_id: str, start: int, hashes: list[bytes]) -> None:
        if not self.is_loading(request_id):
            return  # cancelled while queued
        payloads: list[bytes] = []
        names: list[str] = []
        for i, tier in enumerate(self.tiers):
            pos = len(payloads)
            if pos >= len(hashes):
                break
            got = tier.lookup_load(hashes[pos:])
            payloads.extend(got)
            names.extend([tier.name] * len(got))
            for upper in self.tiers[:i]:  # promote into the faster tiers
                for h, p in zip(hashes[pos : pos + len(got)], got, strict=True):
                    upper.store(h, p)
        with warnings.catch_warnings():
            # The payloads are immutable bytes; the views are only ever read (copied into
            # the device pool), so torch's "buffer is not writable" warning does not apply.
            warnings.simplefilter("ignore", UserWarning)
            blocks = [torch.frombuffer(p, dtype=torch.uint8) for p in payloads]
        self._finish_load(request_id, StagedLoad(start, blocks, names))

    def _finish_load(self, request_id: str, staged: StagedLoad) -> None:
        with self._cv:
            if request_id in self._loading:
                self._loading.discard(request_id)
                self._staged[request_id] = staged
        self.load_done.set()

    def _do_store(self, job: _StoreJob) -> None:
        raw = job.data.view(torch.uint8).reshape(len(job.hashes), -1).numpy()
        stored: dict[str, list[bytes]] = {}
        for i, h in enumerate(job.hashes):
            missing = [t for t in self.tiers if not t.contains(h)]
            if not missing:
                continue
            payload = raw[i].tobytes()
            for t in missing:
                t.store(h, payload)
                if self.events is not None and t.contains(h):
                    stored.setdefault(t.name, []).append(h)
        bs = self.layout.block_size
        for medium, hashes in stored.items():  # tiers keep no token ids: none in the event
            assert self.events is not None
            self.events.publish(BlockStored(hashes, None, [], bs, medium))
