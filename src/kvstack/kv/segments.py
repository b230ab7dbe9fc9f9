"""SegmentCache: the standalone KV of prompt segments, reused at any offset.

Prefix caching only helps requests that share a *prefix*; agents send the same tool
schemas in different subsets and orders, RAG the same documents after different
questions. A segment's KV is therefore kept under the hash of its own tokens (and the
namespace: model and cache salt), not of what precedes it (EPIC, Hu et al., ICML 2025:
position-independent context caching; CacheBlend, Yao et al., EuroSys 2025).

An entry is computed once *standalone*: the scheduler runs ``[sink][primer][segment]``
as its own sequence at positions ``0 .. s + L - 1`` into blocks the entry owns (``s``
lead tokens: the tokenizer's BOS, the attention sink of StreamingLLM, and the mark's
optional primer, ``serve/chat/segment_primers.py``). A request holding the segment at
positions ``a .. a + L - 1`` gets a copy with the keys re-rotated from position
``s + i`` to ``a + i`` (``model/segment_rows.py``: RoPE is a rotation), so requests
never share an entry's blocks; they copy from them::

    entry (bs 4, s 1):  [S x0 x1 x2][x3 x4 . .]          positions 0 .. 5
    request:            [p0 p1 p2 x0][x1 x2 x3 x4][q0 ...]   x at 3 .. 7: rotate by +2

Blocks: an entry holds one reference on each of its ``ceil((lead + L) / bs)`` blocks;
they are never in the prefix cache. A lead of ``bs`` tokens or more (a primer) is not
computed or kept per entry: its whole blocks are a *shared lead* (``leads``), computed
once, that every fill with that lead reads through its block table, so an entry holds
only ``lead % bs`` lead tokens (the offset of ``x0`` in its first block)::

    shared lead (bs 4):  [S p0 p1 p2][p3 p4 p5 p6]           computed once
    entry:                                       [p7 x0 x1 x2][x3 . . .]   lead 1

A shared lead is dropped when the store needs room and no pending entry reads it.
Entries are evicted whole when the pool needs blocks
(``release``) or the entries would hold more than ``max_fraction`` of it, in the order of
an eviction policy of ``kv/policies.py`` (the prefix cache's ``--eviction-policy`` unless
``--segment-cache`` names another) whose keys are segment keys: ``reserve`` inserts
(held), a request finding an entry is a hit, and an entry is a *candidate* exactly while
it is ready and no admitted request still has to copy it (``users == 0``). An entry that
is still being computed (pending) or that an admitted request has not copied yet is never
evicted, so a request's result never depends on what the pool did between its admission
and its copy. With an ``events`` log, a ready entry is announced as ``SegmentStored`` and
its eviction as ``SegmentRemoved`` (``kv/events.py``).

Invariants (``check_integrity``): each entry holds exactly its blocks, each with
``ref_cnt >= 1`` and no prefix hash; ``users >= 0``; the entries' blocks are distinct
and number ``num_blocks``; the policy's candidates are exactly the ready entries without
users.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

from kvstack.kv.block_pool import BlockPool, KVCacheBlock
from kvstack.kv.events import KVEventLog, SegmentRemoved, SegmentStored
from kvstack.kv.hashing import DIGEST_SIZE, hash_block
from kvstack.kv.policies import EvictionPolicy, make_policy

SegmentKey = bytes
LOADING = "loading"  # an offload-tier lookup of a segment is still running (kv/tiers/)


def segment_key(namespace: bytes, token_ids: Sequence[int]) -> SegmentKey:
    """The key of a segment: its tokens under ``namespace`` (model, salt, sink)."""
    return hash_block(namespace, token_ids)


def segment_namespace(model_id: str, salt: str | None, sink: Sequence[int]) -> bytes:
    """What two requests must share to reuse each other's segments."""
    h = blake2b(digest_size=DIGEST_SIZE, person=b"kvstack-segment")
    h.update(model_id.encode() + b"\x00")
    if salt is not None:
        h.update(b"salt:" + salt.encode() + b"\x00")
    h.update(repr(list(sink)).encode())
    return h.digest()


@dataclass(eq=False)
class SegmentEntry:
    key: SegmentKey
    num_tokens: int  # segment tokens (the sink not counted)
    blocks: list[KVCacheBlock]
    ready: bool = False  # False until the step that computes it has run
    users: int = 0  # admitted requests that have not copied it yet
    token_ids: tuple[int, ...] = ()  # the segment's tokens (for SegmentStored)
    lead: int = 0  # tokens before the segment's first in ``blocks`` (< block size)
    shared: tuple[int, ...] = ()  # the shared lead the fill reads (``SegmentCache.leads``)
    shift: int = 0  # the position of ``blocks``' first slot (the shared lead's length)


@dataclass(eq=False)
class SharedLead:
    """The whole blocks of a lead (sink and primer) that fills of that lead read."""

    blocks: list[KVCacheBlock]
    ready: bool = False
    pending: bool = False  # a fill computes it in the step being built


@dataclass
class SegmentCounters:
    """Token counts of ``kvstack:segment_cache_*`` (queries and hits at admission)."""

    query_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0  # standalone prefills (the sink included)
    loaded_tokens: int = 0  # entries loaded from an offload tier instead
    recomputed_tokens: int = 0  # repair rows
    placed_tokens: int = 0  # tokens copied into requests
    evicted: int = 0


@dataclass
class SegmentCache:
    pool: BlockPool
    block_size: int
    sink: tuple[int, ...]
    max_fraction: float = 0.5
    policy_name: str = "lru"
    events: KVEventLog | None = None
    entries: dict[SegmentKey, SegmentEntry] = field(default_factory=dict)
    counters: SegmentCounters = field(default_factory=SegmentCounters)
    leads: dict[tuple[int, ...], SharedLead] = field(default_factory=dict)
    policy: EvictionPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.policy_name, max(1, self.pool.num_blocks))

    @property
    def num_blocks(self) -> int:
        own = sum(len(e.blocks) for e in self.entries.values())
        return own + sum(len(s.blocks) for s in self.leads.values())

    def blocks_for(self, num_tokens: int, lead: int | None = None) -> int:
        """Blocks of an entry of ``num_tokens`` after ``lead`` tokens (default: the sink)."""
        lead = (len(self.sink) if lead is None else lead) % self.block_size
        return -(-(lead + num_tokens) // self.block_size)

    def _make_room(self, need: int, keep: tuple[int, ...] = ()) -> bool:
        """Evict (``release``, sparing the shared lead ``keep``) until ``need`` more
        blocks fit the store's share and the pool; False when they cannot now."""
        cap = int(self.max_fraction * self.pool.num_blocks)
        if need > cap:
            return False
        over = self.num_blocks + need - cap
        if over > 0 and self.release(over, keep) < over:
            return False
        short = need - self.pool.num_free_blocks
        return short <= 0 or self.release(short, keep) >= short

    def split_lead(self, lead: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``lead`` as its whole blocks (a shared lead's key) and the rest (< bs tokens,
        in the entry's first block)."""
        cut = len(lead) // self.block_size * self.block_size
        return lead[:cut], lead[cut:]

    def shared_lead(self, lead: tuple[int, ...]) -> SharedLead | None:
        """The shared blocks of ``lead``'s first ``len // bs`` blocks, allocated (not
        ready: the caller computes them) when missing; None without room now."""
        key = self.split_lead(lead)[0]
        if not key:
            return SharedLead([], ready=True)  # nothing to share
        if key not in self.leads:
            if not self._make_room(len(key) // self.block_size):
                return None
            self.leads[key] = SharedLead(self.pool.allocate(len(key) // self.block_size))
        return self.leads[key]

    def block_lists(self) -> list[list[KVCacheBlock]]:
        """The blocks of every entry and shared lead (each holds one reference)."""
        return [e.blocks for e in self.entries.values()] + [s.blocks for s in self.leads.values()]

    def get(self, key: SegmentKey) -> SegmentEntry | None:
        """The entry under ``key``, counted as a hit of the policy."""
        entry = self.entries.get(key)
        if entry is not None:
            self.policy.on_hit(key)
        return entry

    def reserve(
        self,
        key: SegmentKey,
        num_tokens: int,
        token_ids: Sequence[int] = (),
        lead: Sequence[int] | None = None,
        loaded: bool = False,
    ) -> SegmentEntry | None:
        """A new pending entry with its blocks (after ``lead``: default the sink; its
        whole blocks are a ready ``shared_lead`` unless the entry is ``loaded`` from a
        tier), evicting idle entries for room; None when the pool cannot give the blocks
        now (nothing changes then)."""
        whole, rest = self.split_lead(self.sink if lead is None else tuple(lead))
        shared = () if loaded else whole
        assert not shared or self.leads[shared].ready, "the shared lead is computed first"
        need = self.blocks_for(num_tokens, len(rest))
        if not self._make_room(need, shared):
            return None
        blocks = self.pool.allocate(need)
        entry = SegmentEntry(
            key, num_tokens, blocks, token_ids=tuple(token_ids), lead=len(rest),
            shared=shared, shift=len(whole),
        )  # fmt: skip
        self.entries[key] = entry
        self.policy.on_insert(key)
        return entry

    def hold(self, entry: SegmentEntry) -> None:
        """An admitted request will copy ``entry``: it stops being a candidate."""
        entry.users += 1
        self._sync(entry)

    def unhold(self, entry: SegmentEntry) -> None:
        """A request copied ``entry`` or let go of it."""
        entry.users -= 1
        if self.entries.get(entry.key) is entry:
            self._sync(entry)

    def set_ready(self, entry: SegmentEntry) -> None:
        """``entry``'s KV is in its blocks (computed, or loaded from a tier)."""
        entry.ready = True
        self._sync(entry)
        if self.events is not None:
            self.events.publish(
                SegmentStored(entry.key, entry.num_tokens, list(entry.token_ids), self.block_size)
            )

    def _sync(self, entry: SegmentEntry) -> None:
        """Make the policy's view match: a candidate iff ready and without users."""
        idle = entry.ready and entry.users == 0
        if idle and entry.key not in self.policy:
            self.policy.on_release(entry.key)
        elif not idle and entry.key in self.policy:
            self.policy.on_acquire(entry.key)

    def mark_ready(self) -> list[SegmentEntry]:
        """The step that computed the pending entries has run; returns them."""
        for shared in self.leads.values():
            shared.ready, shared.pending = shared.ready or shared.pending, False
        done = [e for e in self.entries.values() if not e.ready]
        for entry in done:
            self.set_ready(entry)
        return done

    def drop_pending(self) -> None:
        """A failed step: entries it was computing hold nothing usable."""
        for key in [k for k, e in self.entries.items() if not e.ready]:
            self._drop(key)
        for lead in [k for k, s in self.leads.items() if not s.ready]:
            self._drop_lead(lead)

    def _idle_leads(self, keep: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
        """Shared leads no fill computes or reads now (nor ``keep``): free to drop."""
        read = {e.shared for e in self.entries.values() if not e.ready} | {keep}
        return [k for k, s in self.leads.items() if not s.pending and k not in read]

    def _drop_lead(self, lead: tuple[int, ...]) -> int:
        blocks = self.leads.pop(lead).blocks
        self.pool.free(reversed(blocks))
        return len(blocks)

    def evictable_blocks(self) -> int:
        idle = sum(len(e.blocks) for e in self.entries.values() if e.ready and not e.users)
        return idle + sum(len(self.leads[k].blocks) for k in self._idle_leads())

    def release(self, num_blocks: int, keep: tuple[int, ...] = ()) -> int:
        """Evict idle entries in the policy's order, then shared leads no pending entry
        reads (but ``keep``), until ``num_blocks`` blocks went back to the pool or none is
        left; returns how many went back."""
        freed = 0
        while freed < num_blocks and len(self.policy):
            key = self.policy.victim()
            assert isinstance(key, bytes)
            freed += len(self.entries[key].blocks)
            self._drop(key)
            self.counters.evicted += 1
        for lead in self._idle_leads(keep):
            if freed >= num_blocks:
                break
            freed += self._drop_lead(lead)
        return freed

    def _drop(self, key: SegmentKey) -> None:
        entry = self.entries.pop(key)
        self.policy.on_remove(key)
        self.pool.free(reversed(entry.blocks))
        if entry.ready and self.events is not None:
            self.events.publish(SegmentRemoved([key]))

    def reset(self) -> None:
        """Forget every entry (``/reset_prefix_cache``); requests that still meant to copy
        one compute that segment in place instead."""
        for key in list(self.entries):
            self._drop(key)
        for lead in list(self.leads):
            self._drop_lead(lead)
        self.policy.clear()

    def check_integrity(self) -> None:
        seen: set[int] = set()
        for key, entry in self.entries.items():
            assert entry.key == key, "entry filed under another key"
            assert entry.users >= 0, f"segment entry with {entry.users} users"
            assert entry.lead < self.block_size, "a whole lead block in an entry"
            assert len(entry.blocks) == self.blocks_for(entry.num_tokens, entry.lead), "blocks"
            assert entry.ready or not entry.shared or entry.shared in self.leads, "lead freed"
            idle = entry.ready and entry.users == 0
            assert (key in self.policy) == idle, "policy candidate != idle entry"
            for b in entry.blocks:
                assert b.block_id not in seen, f"block {b.block_id} in two segment entries"
                assert b.ref_cnt >= 1 and b.block_hash is None, f"segment block {b.block_id}"
                seen.add(b.block_id)
        for lead, shared in self.leads.items():
            assert len(shared.blocks) * self.block_size == len(lead), "shared lead blocks"
            for b in shared.blocks:
                assert b.block_id not in seen and b.ref_cnt >= 1 and b.block_hash is None
                seen.add(b.block_id)
        assert len(self.policy) == sum(
            1 for e in self.entries.values() if e.ready and not e.users
        ), "policy holds candidates that are not entries"
        self.policy.check_integrity()
