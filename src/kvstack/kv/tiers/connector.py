"""TierConnector: moves KV blocks between the device pool and the offload tiers.

The device side of era 4 (vLLM v1's KV connector shape: the scheduler asks it for
external hits, the engine tells it what was computed). Life of a prompt's blocks::

    add_request ──> device prefix match ─ n_dev blocks
                    └─ submit_load(hashes[n_dev : last full block before the final token])
    (I/O thread)    tiers -> staged blocks        scheduler skips the request meanwhile
    admission   ──> device match again (n >= n_dev) + staged blocks n .. n+k
                    └─ allocate k fresh device blocks, copy the staged K/V in, register
                       them in the prefix cache: from here on they are ordinary device hits
    each step   ──> blocks the step made reusable are copied out -> submit_store
                    (write-through to every tier that lacks them)

Correctness: a loaded block is registered under the hash the tier stored it with, and
the tier checked that hash, the model/dtype namespace and the checksum, so a loaded block
holds exactly the KV that computing the same prefix would write (in the same dtype).
Staged blocks that no longer follow the device prefix (the device lost a block in the
meantime) are dropped: the request recomputes. Nothing is ever loaded into a block a
request is computing, and loads never take blocks from the device prefix they extend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from hashlib import blake2b

import torch

from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.manager import KVCacheManager, cdiv
from kvstack.kv.storage import KVStorage
from kvstack.kv.tiers.block_format import BlockLayout
from kvstack.kv.tiers.manager import OffloadManager
from kvstack.kv.tiers.spec import build_tiers, parse_offload_spec
from kvstack.model.llama import LlamaModel
from kvstack.request import Request

logger = logging.getLogger("kvstack.kv.tiers")


class TierConnector:
    def __init__(self, kv: KVCacheManager, storage: KVStorage, offload: OffloadManager) -> None:
        assert kv.cache is not None, "KV offload needs a prefix cache"
        self.kv = kv
        self.storage = storage
        self.offload = offload
        kv.new_cached_blocks = []  # the manager records newly reusable blocks for us
        # request id -> {block index: tier} of blocks this connector loaded for it, so the
        # cached-token split is right even if admission is retried after the load.
        self._loaded_from: dict[str, dict[int, str]] = {}
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

    def load(
        self,
        req: Request,
        computed: Sequence[KVCacheBlock],
        token_budget: int,
        can_wait: bool,
    ) -> list[KVCacheBlock] | None:
        """Device blocks holding the staged blocks that extend ``computed`` (admission).

        The returned blocks are cached and unreferenced, like device prefix hits; the
        caller adopts ``computed + returned`` with ``allocate_slots``. Returns None when
        the pool has no room for the staged blocks (plus the first chunk after them) and
        ``can_wait`` (others are running and will free blocks): the blocks stay staged
        and the scheduler stops admitting, exactly as when an allocation fails.
        """
        staged = self.offload.take(req.request_id)
        if staged is None or not staged.blocks:
            return []
        n_dev = len(computed)
        skip = n_dev - staged.start
        if skip < 0:
            return []  # the device lost part of the prefix since the lookup: recompute
        avail = staged.num_blocks - skip
        if avail <= 0:
            return []  # the device already has all of it (another request computed it)
        bs = self.kv.block_size
        pool = self.kv.pool
        free = pool.num_free_blocks - sum(1 for b in computed if b.ref_cnt == 0)
        rest = req.num_tokens - (n_dev + avail) * bs
        reserve = cdiv(min(rest, token_budget), bs)
        if avail + reserve > free and can_wait:
            self.offload.restage(req.request_id, staged)
            return None
        n = min(avail, free - reserve)
        if n <= 0:
            return []
        pool.touch(computed)  # so the allocation below cannot evict the prefix it extends
        try:
            blocks = pool.allocate(n)
            tensors = self.storage.block_tensors()
            for block, raw in zip(blocks, staged.blocks[skip : skip + n], strict=True):
                offset = 0
                for t in tensors:  # the payload is each tensor's block slice, in order
                    dst = t[:, block.block_id]
                    size = dst.numel() * dst.element_size()
                    dst.copy_(raw[offset : offset + size].view(t.dtype).view(dst.shape))
                    offset += size
            hashes = self.kv.block_hashes(req)[: n_dev + n]
            assert self.kv.cache is not None
            self.kv.cache.insert(
                req.all_token_ids, hashes, [*computed, *blocks], self.kv.root_of(req)
            )
        finally:
            pool.free(reversed(computed))
        # A block whose hash some other block already serves stays uncached: stop there.
        good = 0
        while good < n and blocks[good].block_hash == hashes[n_dev + good]:
            good += 1
        pool.free(reversed(blocks))
        tiers = self._loaded_from.setdefault(req.request_id, {})
        for i in range(good):
            tiers[n_dev + i] = staged.tiers[skip + i]
        self.num_loaded_blocks += good
        return blocks[:good]

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
        new = self.kv.new_cached_blocks
        assert new is not None
        if not new:
            return
        items = [(h, b) for h, b in new if b.block_hash == h and not self.offload.all_contain(h)]
        new.clear()
        if not items:
            return
        ids = torch.tensor([b.block_id for _, b in items])
        parts = [  # each tensor's block slices, as bytes: [n, bytes of one block]
            t[:, ids].transpose(0, 1).contiguous().view(torch.uint8).reshape(len(items), -1)
            for t in self.storage.block_tensors()
        ]
        data = torch.cat(parts, dim=1)
        self.offload.submit_store([h for h, _ in items], data)

    def discard_step(self) -> None:
        """A failed step: its blocks may be half written, so none of them is stored."""
        if self.kv.new_cached_blocks is not None:
            self.kv.new_cached_blocks.clear()

    def wait_for_loads(self, timeout: float) -> None:
        """Idle engine with only loading requests: sleep until a load lands (or timeout)."""
        if self.offload.has_pending_loads:
            self.offload.load_done.wait(timeout)
            self.offload.load_done.clear()

    def close(self) -> None:
        self.offload.close()

    def check_integrity(self) -> None:
        self.offload.check_integrity()


def model_fingerprint(model: LlamaModel) -> str:
    """A short digest of the model's identity *and weights* (part of every tier key).

    The name alone is not enough: two fine-tunes of one base share it. Hashing a slice of
    the embedding and the final norm costs microseconds and tells weights apart.
    """
    h = blake2b(digest_size=8, person=b"kvstack-model")
    h.update(model.config.name.encode())
    h.update(repr(model.config).encode())
    for t in (model.embed[:64], model.norm):
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_connector(
    spec: str, model: LlamaModel, kv: KVCacheManager, storage: KVStorage, dtype: str
) -> TierConnector:
    """Build the tiers of a ``--kv-offload`` spec and the connector over them."""
    mc = model.config
    layout = BlockLayout(
        model_fingerprint=model_fingerprint(model),
        dtype=dtype,
        block_size=storage.block_size,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        itemsize=torch.empty((), dtype=storage.dtype).element_size(),
        codec=storage.codec.name,
        codec_bytes=0
        if storage.codec.identity
        else sum(t[:, 0].numel() * t.element_size() for t in storage.block_tensors()),
    )
    tiers = build_tiers(parse_offload_spec(spec), layout)
    logger.info(
        "KV offload (write-through, lookup order as given): %s; %d KiB per block",
        "; ".join(t.describe() for t in tiers),
        layout.payload_bytes // 1024,
    )
    return TierConnector(kv, storage, OffloadManager(tiers, layout, events=kv.events))
