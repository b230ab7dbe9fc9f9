"""TierConnector: moves KV blocks between the device pool and the offload tiers.

The device side of the offload tiers, in vLLM v1's KV connector shape: the connector reports how
many blocks it can supply, the KV manager allocates them (``allocate_slots(...,
num_external_blocks=k)``), the connector writes their bytes through ``KVStorage``, and
the engine tells it what each step computed. Life of a prompt's blocks::

    add_request ──> device prefix match ─ n_dev blocks
                    └─ submit_load(hashes[n_dev : last full block before the final token])
    (I/O thread)    tiers -> staged blocks        scheduler skips the request meanwhile
    admission   ──> device match again (n >= n_dev); match_external: k staged blocks fit
                    allocate_slots(computed, num_external_blocks=k) registers them in the
                    prefix cache; write_external copies the staged K/V in: from here on
                    they are ordinary device blocks
    each step   ──> blocks the step made reusable are copied out -> submit_store
                    (write-through to every tier that lacks them)

Correctness: a loaded block is registered under the hash the tier stored it with, and
the tier checked that hash, the model/dtype namespace and the checksum, so a loaded block
holds exactly the KV that computing the same prefix would write (in the same dtype).
Staged blocks that no longer follow the device prefix (the device lost a block in the
meantime) are dropped: the request recomputes. The KV is written before the step that
first reads it runs (admission happens in ``schedule``, the runner after it).

KV groups (the hybrid KV manager, ``kv/hybrid.py``): a tier block is a *logical* block,
every group's page of one block index in group order, so its payload has every layer's
KV as with one block table (in another order: the layout's namespace names the groups).
A load writes only the pages the request holds (``logical_pages``: a window group holds
only its last window's), and the room it needs is the manager's ``admission_cost``::

    logical block i  = [page of group 0][page of group 1] ... [page of group G-1]
    load of blocks 5..9, W = 2 blocks:  group 0 writes 5 6 7 8 9, a window group 8 9

The connector knows the model only by its weights fingerprint (a string, part of every
tier key), never the model itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstack.core.request import Request
from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.paged_common import PagedCommon
from kvstack.kv.storage import KVStorage
from kvstack.kv.tiers.base import TierStats
from kvstack.kv.tiers.block_format import BlockLayout
from kvstack.kv.tiers.manager import OffloadManager, StagedLoad
from kvstack.kv.tiers.spec import build_tiers, parse_offload_spec

logger = logging.getLogger("kvstack.kv.tiers")


@dataclass
class _Match:
    """Staged blocks offered to a request at admission, until it is admitted."""

    staged: StagedLoad
    skip: int  # staged blocks the device already holds
    n_dev: int  # device prefix-hit blocks they extend
    n: int  # blocks offered


class TierConnector:
    def __init__(self, kv: PagedCommon, storage: KVStorage, offload: OffloadManager) -> None:
        assert kv.enable_prefix_caching, "KV offload needs a prefix cache"
        self.kv = kv
        self.storage = storage
        self.offload = offload
        kv.track_new_cached_blocks()  # the manager records newly reusable blocks for us
        # request id -> {block index: tier} of blocks this connector loaded for it, so the
        # cached-token split is right even if admission is retried after the load.
        self._loaded_from: dict[str, dict[int, str]] = {}
        self._matched: dict[str, _Match] = {}
        self.num_loaded_blocks = 0

    # ------------------------------------------------------------------ requests
    def _loadable_hashes(self, req: Request) -> list[bytes]:
        if req.sampling_params.prompt_logprobs is not None:
            return []  # every prompt position must be computed
        return self.kv.block_hashes(req)[: (req.num_tokens - 1) // self.kv.block_size]

    def on_request_added(self, req: Request) -> None:
        hashes = self._loadable_hashes(req)
        n_dev = len(self.kv.get_computed_blocks(req))
        if n_dev < len(hashes):
            self.offload.submit_load(req.request_id, n_dev, hashes[n_dev:])

    def is_loading(self, req: Request) -> bool:
        return self.offload.is_loading(req.request_id)

    def on_request_finished(self, request_id: str) -> None:
        self.offload.cancel(request_id)
        self._loaded_from.pop(request_id, None)
        self._matched.pop(request_id, None)

    def match_external(
        self,
        req: Request,
        computed: Sequence[KVCacheBlock],
        token_budget: int,
        can_wait: bool,
    ) -> int | None:
        """How many staged blocks extend the device hit ``computed`` and fit (admission).

        The caller allocates them (``allocate_slots(..., num_external_blocks=k)``, any
        ``k`` up to this) and calls ``write_external``. Returns None when the pool has no
        room for the staged blocks (plus the first chunk after them) and ``can_wait``
        (others are running and will free blocks): the blocks stay staged and the
        scheduler stops admitting, exactly as when an allocation fails.
        """
        rid = req.request_id
        held = self._matched.pop(rid, None)
        staged = held.staged if held is not None else self.offload.take(rid)
        if staged is None or not staged.blocks:
            return 0
        n_dev = len(computed)
        skip = n_dev - staged.start
        if skip < 0:
            return 0  # the device lost part of the prefix since the lookup: recompute
        avail = staged.num_blocks - skip
        if avail <= 0:
            return 0  # the device already has all of it (another request computed it)
        free = self.kv.num_free_blocks

        def cost(n: int) -> int:  # pages to load n blocks and hold the first chunk after
            rest = req.num_tokens - (n_dev + n) * self.kv.block_size
            return self.kv.admission_cost(req, computed, n, min(rest, token_budget))

        if cost(avail) > free and can_wait:
            self._matched[rid] = _Match(staged, skip, n_dev, 0)
            return None
        lo, hi = 0, avail  # the most blocks that fit (the cost grows with n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= free else (lo, mid - 1)
        if lo <= 0 or cost(lo) > free:
            return 0
        self._matched[rid] = _Match(staged, skip, n_dev, lo)
        return lo

    def write_external(self, req: Request, first: int, end: int) -> None:
        """Copy the offered blocks into logical blocks ``first <= i < end`` of ``req``
        (allocated by ``allocate_slots(..., num_external_blocks=end - first)``)."""
        m = self._matched.pop(req.request_id)
        if end <= first:  # a press capped the hit (scheduler): nothing loaded
            return
        assert first == m.n_dev and end - first <= m.n, "other blocks than were offered"
        pages = self.kv.logical_pages(req.request_id, first, end)
        for i, ids in enumerate(pages):
            raw = m.staged.blocks[m.skip + i]
            size = len(raw) // len(ids)
            for g, page in enumerate(ids):
                if page is not None:  # a window group's page no row reads is not held
                    self.storage.write_block(page, raw[g * size : (g + 1) * size])
        tiers = self._loaded_from.setdefault(req.request_id, {})
        for i in range(len(pages)):
            tiers[m.n_dev + i] = m.staged.tiers[m.skip + i]
        self.num_loaded_blocks += len(pages)

    def cached_tokens_by_tier(self, req: Request, num_cached_blocks: int) -> dict[str, int]:
        """Split of a request's first-admission cache hit: device vs each tier."""
        bs = self.kv.block_size
        out = {"device": 0} | {t.name: 0 for t in self.offload.tiers}
        loaded = self._loaded_from.get(req.request_id, {})
        for i in range(num_cached_blocks):
            out[loaded.get(i, "device")] += bs
        return out

    # ------------------------------------------------------------------ steps
    def after_step(self) -> None:
        """Copy out the blocks the finished step made reusable and queue them for storing."""
        items = [
            (h, p) for h, p in self.kv.pop_new_cached_blocks() if not self.offload.all_contain(h)
        ]
        if items:  # one row of every page, then each logical block's pages as one row
            data = self.storage.read_blocks([page for _, pages in items for page in pages])
            self.offload.submit_store([h for h, _ in items], data.reshape(len(items), -1))

    def discard_step(self) -> None:
        """A failed step: its blocks may be half written, so none of them is stored."""
        self.kv.discard_new_cached_blocks()

    def wait_for_loads(self, timeout: float) -> None:
        """Idle engine with only loading requests: sleep until a load lands (or timeout)."""
        if self.offload.has_pending_loads:
            self.offload.load_done.wait(timeout)
            self.offload.load_done.clear()

    def stats(self) -> dict[str, TierStats]:
        """Per-tier counters (``EngineStats.offload``)."""
        return self.offload.stats()

    def held_hashes(self) -> dict[str, list[bytes]]:
        """Block hashes of each tier that can list them (host, disk; not shared Redis)."""
        held = {}
        for tier in self.offload.tiers:
            hashes = tier.held_hashes()
            if hashes is not None:
                held[tier.name] = hashes
        return held

    def flush(self, timeout_s: float) -> bool:
        """Wait until queued stores and loads are done; False on timeout (any thread)."""
        return self.offload.flush(timeout_s)

    def close(self) -> None:
        self.offload.close()

    def check_integrity(self) -> None:
        self.offload.check_integrity()
        for rid, m in self._matched.items():
            assert m.skip >= 0 and m.n <= m.staged.num_blocks - m.skip, f"bad match of {rid}"


def make_connector(
    spec: str, fingerprint: str, kv: PagedCommon, storage: KVStorage, dtype: str,
    auth_key: bytes | None = None,
) -> TierConnector:  # fmt: skip
    """Build the tiers of a ``--kv-offload`` spec and the connector over them.

    ``fingerprint`` names the model and its weights (``model/loader/fingerprint.py``); tiers
    keep blocks of different fingerprints, dtypes or codecs apart. ``auth_key``
    (``--kv-offload-key-file``): blocks are HMAC-signed with it (``block_format.py``).
    """
    shape, groups = storage.shape, storage.groups
    pages = 1 if groups is None else groups.num_groups  # pages of one logical block
    layout = BlockLayout(
        model_fingerprint=fingerprint,
        dtype=dtype,
        block_size=storage.block_size,
        num_layers=shape.num_layers * pages,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        itemsize=storage.itemsize,
        codec=storage.codec.name,
        codec_bytes=0 if storage.codec.identity else storage.block_nbytes * pages,
        auth_key=auth_key,
        kv_groups="" if groups is None else groups.signature(),
    )
    tiers = build_tiers(parse_offload_spec(spec), layout)
    logger.info(
        "KV offload (write-through, lookup order as given): %s; %d KiB per block%s",
        "; ".join(t.describe() for t in tiers),
        layout.payload_bytes // 1024,
        ", HMAC-signed" if auth_key is not None else "",
    )
    return TierConnector(kv, storage, OffloadManager(tiers, layout, events=kv.events))
