"""The hybrid KV manager (kv/hybrid.py) and its groups (kv/groups.py), no model.

Checked: the grouping of Gemma 3 / Qwen2 / Mistral layer patterns; a window group frees
the blocks no later row reads while decoding and never allocates them for long prompts;
prefix hits need every block of a full group and only the window's blocks of a window
group (a fixpoint over groups); rollback, preemption-style frees, eviction of freed
cached blocks; KV events name group 0's blocks only (a window-only model's too); what is
refused.
"""

from __future__ import annotations

import random

import pytest

from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.request import Request, SamplingParams
from kvstack.kv.base import cdiv
from kvstack.kv.events import BlockRemoved, BlockStored
from kvstack.kv.groups import KVGroups
from kvstack.kv.hashing import hash_blocks, root_hash
from kvstack.kv.hybrid import HybridKVManager

BS = 4
W = 8


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(
        rid, list(tokens), SamplingParams(temperature=0.0, max_tokens=64), cache_salt=salt
    )


def manager(
    windows: list[int | None], pages: int = 64, chunk: int = 64, cache: str = "hash"
) -> HybridKVManager:
    return HybridKVManager(KVGroups.plan(windows), pages, BS, chunk, prefix_cache=cache)


CACHES = pytest.mark.parametrize("cache", ["hash", "radix"])


def evict(kv: HybridKVManager, key: bytes) -> None:
    """Evict the cached page under ``key`` (as the pool would, chosen by the test)."""
    assert kv.cache is not None
    kv.cache.policy.on_remove(key)
    block = kv.cache._detach(key)
    block.block_hash = None
    kv.pool.reclaim([block])


def admit(kv: HybridKVManager, r: Request, chunk: int | None = None) -> int:
    """Admit ``r`` (its whole prompt, or its first ``chunk`` tokens after the hit)."""
    computed = kv.get_computed_blocks(r)
    cached = len(computed) * BS
    n = r.num_tokens - cached if chunk is None else min(chunk, r.num_tokens - cached)
    assert kv.allocate_slots(r, n, computed) is not None
    r.num_computed_tokens = cached + n
    kv.check_integrity()
    return cached


def decode(kv: HybridKVManager, r: Request, steps: int) -> None:
    for i in range(steps):
        r.output_token_ids.append(1000 + i)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        kv.check_integrity()


def test_groups_of_gemma3_qwen2_and_mistral() -> None:
    gemma = KVGroups.plan([None if (i + 1) % 6 == 0 else 512 for i in range(18)])
    assert gemma.layers_per_page == 3 and gemma.num_groups == 6
    assert gemma.groups[0].window is None and gemma.groups[0].layers == (5, 11, 17)
    assert [g.layers for g in gemma.groups[1:3]] == [(0, 1, 2), (3, 4, 6)]
    assert gemma.locate(6) == (2, 2) and gemma.layer_slots()[6] == 2
    assert gemma.layer_groups()[17] == 0 and gemma.hybrid
    assert "1 x full, 5 x window 512" in gemma.describe()
    qwen = KVGroups.plan([None] * 10 + [64] * 4)
    assert qwen.layers_per_page == 2 and qwen.num_groups == 7
    mistral = KVGroups.plan([4096] * 4)
    assert mistral.num_groups == 1 and mistral.layers_per_page == 4 and mistral.hybrid
    llama = KVGroups.plan([None] * 4)
    assert llama.num_groups == 1 and not llama.hybrid
    widths = KVGroups.plan([16, None, 32, 16, None, 32])
    assert widths.windows == (None, 32, 16)  # full first, then wider windows


def test_decoding_frees_what_no_window_reads() -> None:
    kv = manager([None, W])
    r = req("r", list(range(10)))
    admit(kv, r)
    assert kv.num_held_pages("r") == 2 * cdiv(10, BS)
    decode(kv, r, 30)  # 40 tokens
    full, window = kv.group_block_ids("r") or []
    assert 0 not in full and len(full) == 10
    # the next row (position 40) reads keys 33..40: blocks 8..10; older ones are page 0
    first = (40 - W + 1) // BS
    assert window[:first] == [0] * first and 0 not in window[first:]
    assert kv.num_held_pages("r") == 10 + (10 - first)
    assert kv.num_held_pages("r") == KVGroups.plan([None, W]).pages_held(40, BS)
    kv.free(r)
    kv.check_integrity()
    assert kv.usage == 0.0 and kv.num_free_blocks == kv.num_blocks


def test_long_prompts_allocate_only_what_a_chunk_reads() -> None:
    kv = manager([W], pages=64)
    r = req("r", list(range(100)))
    admit(kv, r, chunk=16)  # rows 0..15: blocks 0..3
    assert (kv.group_block_ids("r") or [[]])[0] == [1, 2, 3, 4]
    for _ in range(5):  # further chunks of 16: each reads back W - 1 keys only
        c = r.num_computed_tokens
        assert kv.allocate_slots(r, 16) is not None
        r.num_computed_tokens += 16
        kv.check_integrity()
        live = [b for b in (kv.group_block_ids("r") or [[]])[0] if b]
        assert len(live) == cdiv(c + 16, BS) - (c - W + 1) // BS
    assert kv.num_held_pages("r") <= cdiv(W - 1 + 16, BS) + 1
    assert kv.num_blocks_for(100) == cdiv(W - 1 + 64, BS) + 1  # one table: 25


@CACHES
def test_prefix_hits_need_the_window_blocks_only(cache: str) -> None:
    kv = manager([None, W], pages=200, cache=cache)
    a = req("a", list(range(40)))
    admit(kv, a)
    kv.free(a)
    kv.check_integrity()
    b = req("b", [*range(40), 7, 7])
    assert admit(kv, b) == 40  # 10 blocks of both groups cached
    kv.free(b)
    # Evict the window group's early blocks only: hits still reach 40 tokens.
    cache = kv.cache
    assert cache is not None
    root = root_hash()
    for h in hash_blocks(list(range(40)), BS, root)[:5]:
        evict(kv, h + bytes((1,)))
    kv.check_integrity()
    c = req("c", [*range(40), 9])
    assert admit(kv, c) == 40
    tables = kv.group_block_ids("c") or []
    assert tables[1][: (40 - W + 1) // BS] == [0] * ((40 - W + 1) // BS)
    kv.free(c)
    # A hit ending at 24 tokens would need window blocks 4 and 5: block 4 is gone, so
    # the hit falls back to where the window group has a whole window cached: none.
    d = req("d", [*range(24), 5])
    assert admit(kv, d) == 0
    kv.free(d)
    kv.check_integrity()


@CACHES
def test_the_hit_is_a_fixpoint_over_window_groups(cache: str) -> None:
    kv = manager([None, 2 * BS + 1, 3 * BS + 1], pages=300, cache=cache)
    toks = list(range(48))
    admit(kv, req("a", toks))
    kv.free("a")
    drop = {(2, 8), (1, 9)}  # group 2 misses block 8, group 1 block 9
    hashes = hash_blocks(toks, BS, root_hash())
    assert kv.cache is not None
    for g, i in drop:
        evict(kv, hashes[i] + bytes((g,)))
    hit = admit(kv, req("b", [*toks, 1]))
    # group 1 (window 9: needs blocks L-3..L-1) fails for L in 10..12 (block 9), group 2
    # (window 13: blocks L-4..L-1) fails for L in 9..12: L = 8 both serve.
    assert hit == 8 * BS
    kv.check_integrity()


@CACHES
def test_rollback_and_free_return_every_page(cache: str) -> None:
    kv = manager([None, W], pages=40, cache=cache)
    r = req("r", list(range(13)))
    admit(kv, r)
    before = kv.num_held_pages("r")
    assert kv.allocate_slots(r, 1 + 6) is not None  # the last token's row + 6 drafts
    assert kv.num_held_pages("r") > before
    assert kv.rollback_slots(r) > 0
    kv.check_integrity()
    # Back to 4 blocks per group, less the window group's block 0 (rows from 13 on
    # read keys >= 6): it died when the drafts were scheduled and stays freed.
    assert [len(t) for t in kv.group_block_ids("r") or []] == [4, 4]
    assert kv.num_held_pages("r") == before - 1
    kv.free(r)
    kv.free(r)  # idempotent
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_no_room_changes_nothing_and_dead_blocks_count_as_room() -> None:
    kv = manager([W], pages=7)  # 6 usable
    r = req("r", list(range(20)))
    assert kv.allocate_slots(r, 28) is None  # 7 blocks > 6
    assert not kv.held_request_ids()
    admit(kv, r)  # 5 blocks
    r.num_computed_tokens = 20
    # Rows from 20 read keys >= 13 (blocks 3..): blocks 0..2 die, so 8 more tokens fit.
    assert kv.allocate_slots(r, 8) is not None
    kv.check_integrity()


@CACHES
@pytest.mark.parametrize("windows", [[None, W, None, W], [W, 2 * W]], ids=["gemma", "mistral"])
def test_random_traffic_keeps_integrity(cache: str, windows: list[int | None]) -> None:
    rng = random.Random(5)
    kv = manager(windows, pages=120, cache=cache)
    live: dict[str, Request] = {}
    for step in range(300):
        if live and rng.random() < 0.3:
            rid = rng.choice(sorted(live))
            kv.free(live.pop(rid))
        elif rng.random() < 0.5 and len(live) < 6:
            base = rng.choice([list(range(30)), list(range(5, 40)), []])
            r = req(f"r{step}", base + [rng.randrange(500) for _ in range(rng.randrange(1, 20))])
            computed = kv.get_computed_blocks(r)
            cached = len(computed) * BS
            if kv.allocate_slots(r, r.num_tokens - cached, computed) is not None:
                r.num_computed_tokens = r.num_tokens
                live[r.request_id] = r
        elif live:
            r = live[rng.choice(sorted(live))]
            r.output_token_ids.append(rng.randrange(500))
            if kv.allocate_slots(r, 1) is None:
                kv.free(live.pop(r.request_id))
            else:
                r.num_computed_tokens += 1
        kv.check_integrity()
    for r in live.values():
        kv.free(r)
    kv.check_integrity()
    assert kv.usage == 0.0


def test_events_name_full_group_blocks_only() -> None:
    kv = manager([W, None], pages=64)
    seen: list[object] = []
    kv.events.subscribe(seen.append)
    admit(kv, req("a", list(range(17))))
    stored = [e for e in seen if isinstance(e, BlockStored)]
    assert stored and all(len(h) == len(root_hash()) for e in stored for h in e.block_hashes)
    assert sum(len(e.block_hashes) for e in stored) == 4
    assert stored[0].token_ids == list(range(16))
    assert len(kv.cached_hashes()) == 4  # the window group's 4 keys are not listed
    only_windows = manager([W, W], pages=64)  # Mistral: group 0 is a window group
    seen.clear()
    only_windows.events.subscribe(seen.append)
    admit(only_windows, req("a", list(range(17))), chunk=16)
    admit(only_windows, req("b", list(range(13)) + [99] * 8))  # 3 blocks shared, then new
    chains = [e.block_hashes for e in seen if isinstance(e, BlockStored)]
    assert sum(map(len, chains)) == 6 and len(only_windows.cached_hashes()) == 6
    assert all(len(h) == len(root_hash()) for c in chains for h in c)
    assert seen[-1].parent_block_hash == chains[0][2]  # "b" continues "a"'s chain
    only_windows.check_integrity()


def test_radix_keeps_the_full_group_in_the_tree_and_window_pages_apart() -> None:
    """--prefix-cache radix: group 0 (full) in the token tree, held along a running
    request's path; its window pages, freed while it decodes, are evictable at once (a
    "tombstone" in SGLang's SWA radix cache): another request's allocation evicts them,
    never the tree's pages, and no event names them."""
    kv = manager([None, W], pages=25, cache="radix")  # 24 usable pages
    seen: list[object] = []
    kv.events.subscribe(seen.append)
    a = req("a", list(range(40)))
    admit(kv, a)
    decode(kv, a, 1)  # rows from 41 read keys >= 34: window blocks 0..7 die, stay cached
    cache = kv.cache
    assert cache is not None and cache.num_evictable == 8
    admit(kv, req("b", [500 + i for i in range(12)]))  # 6 pages: 2 free, 4 evicted
    assert cache.num_evictable == 4 and kv.num_free_blocks == 4
    assert not [e for e in seen if isinstance(e, BlockRemoved)], "window pages have no events"
    assert len(cache.cached_hashes()) == 10 + 3  # a's and b's full blocks, in the tree
    stored = [e for e in seen if isinstance(e, BlockStored)]
    assert stored[0].token_ids == list(range(40)) and len(stored[0].block_hashes) == 10
    kv.free("a")
    kv.free("b")
    assert admit(kv, req("c", [*range(40), 7])) == 40  # blocks 8, 9 of the window: cached
    # The window pages evicted were blocks 7..4 (a freed them newest first; LRU takes the
    # first released): a 20-token hit needs window blocks 3 and 4, so it falls back to 16
    # tokens (blocks 2 and 3); matching d's tokens split a's tree node after block 5.
    assert admit(kv, req("d", [*range(20), 900, 901, 902, 903, 1])) == 16
    kv.check_integrity()


def test_radix_of_a_window_only_model_keeps_tombstones() -> None:
    """--prefix-cache radix when every layer slides (Mistral; kv/hybrid_window_radix.py):
    the tree holds tokens, pages sit under their keys and go as soon as nothing holds
    them; a node whose pages all went stays while nodes below it live (a tombstone) and
    is pruned with its last descendant; a hit is matched token by token first."""
    kv = manager([W, 2 * W], pages=40, cache="radix")
    a = req("a", list(range(40)))
    admit(kv, a)
    decode(kv, a, 1)  # rows from 41 read keys >= 34 (W) and >= 26 (2W)
    cache = kv.cache
    assert cache is not None and cache.name == "radix"
    assert cache.num_evictable == 8 + 6 and len(cache.nodes) == 10  # type: ignore[union-attr]
    hashes = kv.block_hashes(a)
    assert sorted(kv.first_live(g, 41) for g in range(2)) == [6, 8]
    for g in range(2):  # evict every page a's windows no longer read
        for h in hashes[: kv.first_live(g, 41)]:
            evict(kv, cache.key(g, h))
    kv.check_integrity()
    assert len(cache.nodes) == 10, "blocks 0-5: tombstones under live blocks"  # type: ignore[union-attr]
    root = kv.root_of(a)
    other = [*range(36), 7, 7, 7, 7]  # the same hashes claimed for other tokens: no hit
    assert cache.hit_length(hashes, 10, other, root) == 0
    kv.free(a)
    assert admit(kv, req("c", [*range(40), 7])) == 40  # 10 blocks: windows' pages cached
    kv.free("c")
    assert admit(kv, req("d", [*range(20), 900])) == 0  # 5 blocks: block 1-4 pages gone
    kv.free("d")
    for key in list(cache.table):
        evict(kv, key)
    kv.check_integrity()
    assert not cache.nodes and not cache.roots and kv.usage == 0.0  # type: ignore[union-attr]


def test_what_is_refused() -> None:
    with pytest.raises(ConfigError, match="--prefix-cache lru_tree"):
        HybridKVManager(KVGroups.plan([None, W]), 16, BS, 16, prefix_cache="lru_tree")
    kv = manager([None, W])
    with pytest.raises(InvalidRequestError, match="at least one full block"):
        kv.check_pinnable(BS - 1)
    with pytest.raises(InvalidRequestError, match="pins may hold at most"):
        kv.check_pinnable(64 * BS)
    with pytest.raises(InvalidRequestError, match="cached in every KV group"):
        kv.pin_prefix(list(range(16)))
    assert not kv.held_request_ids()


def test_external_blocks_are_logical_blocks() -> None:
    """An offload connector's view: ``num_external_blocks`` logical blocks get a page in the
    full group and, in the window group, only where the step's rows read; the admission
    cost is exactly the pages taken; loaded blocks are never reported as new, computed
    ones are, with every group's page."""
    kv = manager([None, W], pages=64)
    kv.track_new_cached_blocks()
    r = req("r", list(range(30)))  # 7 loadable blocks, then 2 tokens to compute
    cost = kv.admission_cost(r, [], 7, 2)
    free = kv.num_free_blocks
    assert kv.allocate_slots(r, 2, (), num_external_blocks=7) is not None
    assert free - kv.num_free_blocks == cost == 8 + 3  # full 0-7; window: rows 28.. read 5-7
    pages = kv.logical_pages("r", 0, 7)
    assert all(p[0] is not None for p in pages)
    assert [p[1] is not None for p in pages] == [False] * 5 + [True] * 2
    r.num_computed_tokens = 30
    kv.check_integrity()
    assert kv.pop_new_cached_blocks() == []  # blocks 0-6 came from the tier
    decode(kv, r, 2)  # block 7 fills
    ((h, ids),) = kv.pop_new_cached_blocks()
    assert h == kv.block_hashes(r)[7] and ids == [p for p in kv.logical_pages("r", 7, 8)[0]]
    kv.free(r)
    kv.check_integrity()
    assert kv.usage == 0.0


def test_the_web_views_block_map_draws_every_groups_pages() -> None:
    from kvstack.kv.block_view import PINNED, USED, view_blocks

    kv = manager([None, W], pages=32)
    r = req("r", list(range(30)))
    admit(kv, r)
    decode(kv, r, 4)
    view = view_blocks(kv)
    assert view.num_blocks == 32 and view.state[0] == PINNED  # the null page
    assert view.state.count(USED) == kv.num_held_pages("r")
    assert view.request_ids == ["r"]


def test_a_pin_holds_every_page_of_its_hit() -> None:
    """A pinned 40-token prefix: every full-group block and the window group's last
    window; a flood of other prompts evicts everything else, the hit stays whole."""
    kv = manager([None, W], pages=60)
    prefix = list(range(40))
    admit(kv, req("a", [*prefix, 1]))
    kv.free("a")
    assert kv.pin_prefix(prefix) == 40
    assert kv.pin_prefix(prefix) == 40  # twice: one pin
    first = (40 - W + 1) // BS
    assert kv.num_pinned_blocks == 10 + (10 - first)
    kv.check_integrity()
    for i in range(12):  # fill the rest of the pool with other prompts, evicting
        r = req(f"f{i}", [500 + i] * 30)
        admit(kv, r)
        kv.free(r)
    assert kv.pool.num_evicted_blocks > 0
    assert admit(kv, req("b", [*prefix, 2])) == 40
    kv.free("b")
    assert kv.unpin_prefix(prefix) and not kv.unpin_prefix(prefix)
    assert kv.num_pinned_blocks == 0
    kv.check_integrity()
    kv.pin_prefix(prefix)
    kv.reset_prefix_cache()  # drops pins too
    kv.check_integrity()
    assert kv.num_pinned_blocks == 0 and kv.num_free_blocks == kv.num_blocks


@CACHES
@pytest.mark.parametrize("windows", [[None, W], [W, W + 4]])
def test_forget_drops_only_the_failed_steps_pages(cache: str, windows: list[int | None]) -> None:
    """A failed step's pages (every group's) leave the cache; other entries and pins stay,
    and a later prompt hits only up to the first forgotten block."""
    kv = manager(windows, pages=200, cache=cache)
    shared = list(range(24))
    admit(kv, req("a", [*shared, 1]))
    kv.free("a")
    assert kv.pin_prefix(list(range(16))) == 16
    pinned = kv.num_pinned_blocks
    b = req("b", [*shared, *range(100, 117)])
    assert admit(kv, b) == 24
    tables = kv.group_block_ids("b") or []
    written = sorted({p for t in tables for p in t[6:]} - {0})  # b's own blocks 6..9
    kv.forget_blocks(written)
    kv.check_integrity()
    assert kv.num_pinned_blocks == pinned
    kv.free(b)
    kv.check_integrity()
    assert admit(kv, req("c", [*shared, *range(100, 117)])) == 24  # a's blocks still hit
    kv.free("c")
    kv.check_integrity()
