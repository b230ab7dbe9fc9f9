"""What every block of the paged device pool holds, for the web view's block map.

``view_blocks(manager, ...)`` reads the pool once (O(num_blocks), plain ints) and returns
a ``BlockView``: one cell per block, or, for pools with more blocks than ``max_cells``,
one cell per run of ``group`` consecutive block ids with how many of them are in each
state. The view is what the server's ``/v1/kv/state`` stream sends; it is only ever
computed while someone watches (``serve/kv_state_stream.py``), on the engine thread.

States (``STATES``; a block is in exactly one, first match wins):

* ``pinned``: held by a pin (``/v1/cache/pin``), whether a request also uses it or not
  (and the hybrid manager's null page, ``kv/hybrid.py``; its cells are every group's pages);
* ``pressed``: held by a running request whose press (era 5) has run;
* ``segment``: held by the segment cache (issue 18, ``kv/segments.py``): a segment's
  standalone KV, ready or being computed;
* ``used``: held by a running request (``owner`` says which);
* ``cached``: unreferenced, in the prefix cache, evictable; ``rank`` is its place in the
  eviction policy's order scaled to 0..255 (0: the next victim), -1 when the policy
  cannot say (the Belady oracle);
* ``free``: plain free, no contents.

Invariants: ``len(state) == len(owner) == len(rank) == num_cells``;
``num_cells == ceil(num_blocks / group) <= max_cells``; for a grouped view each
``counts[i]`` sums to the blocks of cell ``i`` (``group``, the last cell possibly fewer)
and ``state[i]`` is the state with the most blocks there (ties: the earlier in
``STATES``); ``owner[i]`` indexes ``request_ids`` or is -1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from kvstack.kv.block_pool import KVCacheBlock
from kvstack.kv.hybrid import HybridKVManager
from kvstack.kv.manager import KVCacheManager

PagedManager = KVCacheManager | HybridKVManager

STATES = ("free", "used", "cached", "pinned", "pressed", "segment")
FREE, USED, CACHED, PINNED, PRESSED, SEGMENT = range(len(STATES))
# Order that decides a grouped cell's colour on ties: the rarer, more telling state first.
_PRIORITY = (PINNED, PRESSED, SEGMENT, USED, CACHED, FREE)


@dataclass
class BlockView:
    num_blocks: int
    group: int  # blocks per cell (1: one cell per block)
    state: list[int]  # index into STATES, per cell
    owner: list[int]  # index into request_ids, -1: none
    rank: list[int]  # 0..255 eviction rank of a cached cell (0 next), -1: none / unknown
    request_ids: list[str]
    counts: list[list[int]] = field(default_factory=list)  # per cell, per state (group > 1)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "num_blocks": self.num_blocks, "group": self.group, "states": list(STATES),
            "state": self.state, "owner": self.owner, "rank": self.rank,
            "request_ids": self.request_ids,
        }  # fmt: skip
        if self.group > 1:
            d["counts"] = self.counts
        return d


def _held(
    manager: PagedManager,
) -> tuple[dict[str, list[KVCacheBlock]], list[KVCacheBlock], list[KVCacheBlock]]:
    """Each request's blocks (every group's pages), the pinned blocks (and the hybrid
    manager's null page: reserved, drawn as pinned) and the segment cache's blocks (the
    hybrid manager has none: segments are refused with windows)."""
    if isinstance(manager, KVCacheManager):
        pinned = [b for chain in manager.pins.values() for b in chain]
        entries = manager.segments.entries.values() if manager.segments is not None else ()
        return dict(manager.req_blocks), pinned, [b for e in entries for b in e.blocks]
    null = manager.null
    held = {rid: [b for t in ts for b in t if b is not null] for rid, ts in manager.tables.items()}
    return held, [null, *(b for chain in manager.pins.values() for b in chain)], []


def _block_states(
    manager: PagedManager, pressed: Collection[str]
) -> tuple[list[int], list[int], list[int], list[str]]:
    """Per block: state, owner index, eviction rank (see the module docstring)."""
    n = len(manager.pool.blocks)
    state = [FREE] * n
    owner = [-1] * n
    rank = [-1] * n
    held, pinned, segment = _held(manager)
    request_ids = list(held)
    for i, rid in enumerate(request_ids):
        s = PRESSED if rid in pressed else USED
        for b in held[rid]:
            state[b.block_id] = s
            owner[b.block_id] = i
    for b in segment:
        state[b.block_id] = SEGMENT
    for b in pinned:
        state[b.block_id] = PINNED
    cache = manager.cache
    if cache is not None:
        order = cache.policy.candidate_order()
        scale = 256 / max(1, len(order))
        pos = {h: int(i * scale) for i, h in enumerate(order)}
        for b in manager.pool.blocks:
            if b.ref_cnt == 0 and not b.in_free_queue and b.block_hash is not None:
                state[b.block_id] = CACHED
                rank[b.block_id] = pos.get(b.block_hash, -1)
    return state, owner, rank, request_ids


def view_blocks(
    manager: PagedManager, max_cells: int = 4096, pressed: Collection[str] = ()
) -> BlockView:
    """The pool's blocks as at most ``max_cells`` cells; ``pressed``: ids of running
    requests whose press has run (the manager does not know presses)."""
    if max_cells < 1:
        raise ValueError(f"max_cells must be >= 1, got {max_cells}")
    state, owner, rank, request_ids = _block_states(manager, pressed)
    n = len(state)
    group = -(-n // max_cells)
    if group == 1:
        return BlockView(n, 1, state, owner, rank, request_ids)
    cells = -(-n // group)
    c_state, c_owner, c_rank, counts = [], [], [], []
    for c in range(cells):
        lo, hi = c * group, min(n, (c + 1) * group)
        k = [0] * len(STATES)
        for s in state[lo:hi]:
            k[s] += 1
        top = max(_PRIORITY, key=lambda s: k[s])  # max keeps the first of equal counts
        owners = Counter(o for o in owner[lo:hi] if o >= 0)
        ranks = [r for r in rank[lo:hi] if r >= 0]
        c_state.append(top)
        c_owner.append(owners.most_common(1)[0][0] if owners else -1)
        c_rank.append(min(ranks) if ranks else -1)
        counts.append(k)
    return BlockView(n, group, c_state, c_owner, c_rank, request_ids, counts)
