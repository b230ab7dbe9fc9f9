"""Routing policies and KV indexes (``kvstack.route``) on simulated replicas: no model,
no network, pure bookkeeping."""

from __future__ import annotations

import logging
import random
from collections import Counter, OrderedDict, deque
from typing import Any

import pytest

from kvstack.core.errors import ConfigError
from kvstack.kv.hashing import hash_blocks, root_hash
from kvstack.route.policy import (
    ROUTING_POLICIES,
    BalanceConfig,
    Decision,
    KVEventsPolicy,
    LeastLoadPolicy,
    NoReplicaError,
    PrefixPolicy,
    Replica,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)
from kvstack.route.policy.kv_index import ApproxPrefixIndex, BlockHasher, EventIndex

BS = 4  # block size: small, so short prompts have several blocks
KV_AWARE = ["prefix", "kv_events"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def replicas(*loads: int) -> list[Replica]:
    return [Replica(f"r{i}", inflight=load) for i, load in enumerate(loads)]


def route(policy: RoutingPolicy, toks: list[int], reps: list[Replica]) -> Decision:
    req = RouteRequest(toks)
    decision = policy.choose(req, reps)
    policy.on_routed(req, decision)
    policy.check_integrity()
    return decision


def batch(seq: int, *events: dict[str, Any], snapshot: bool = False) -> dict[str, Any]:
    return {"seq": seq, "ts": 0.0, "snapshot": snapshot, "events": list(events)}


def stored(hashes: list[bytes], medium: str = "device") -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [h.hex() for h in hashes],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": BS,
        "medium": medium,
    }


def removed(hashes: list[bytes], medium: str = "device") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [h.hex() for h in hashes], "medium": medium}


def snap(hashes: list[bytes], medium: str = "device") -> dict[str, Any]:
    return {"type": "BlockSnapshot", "block_hashes": [h.hex() for h in hashes], "medium": medium}


class Sim:
    """Replicas that serve each request until ``k`` more were sent, cache the blocks of
    every prompt they served in an LRU of ``cache_blocks``, and (``events``) report it
    to a ``kv_events`` policy as wire batches."""

    def __init__(self, policy: RoutingPolicy, n: int = 2, k: int = 6, cache_blocks: int = 10**6):
        self.policy, self.k, self.cache_blocks = policy, k, cache_blocks
        self.hasher = BlockHasher(BS, "")
        self.replicas = [Replica(f"r{i}") for i in range(n)]
        self.by_id = {r.id: r for r in self.replicas}
        self.pending: deque[Replica] = deque()
        self.caches: dict[str, OrderedDict[bytes, None]] = {r.id: OrderedDict() for r in self}
        self.seq = dict.fromkeys(self.by_id, 0)
        self.seen: set[bytes] = set()  # blocks some replica computed before
        self.hit_blocks = self.reusable_blocks = 0
        self.routed: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        if isinstance(policy, KVEventsPolicy):
            for rid in self.by_id:
                policy.index.apply(rid, batch(0, snap([]), snapshot=True))

    def __iter__(self) -> Any:
        return iter(self.replicas)

    def send(self, toks: list[int]) -> Decision:
        d = route(self.policy, toks, self.replicas)
        rep = self.by_id[d.replica_id]
        self.routed[rep.id] += 1
        self.reasons[d.reason] += 1
        rep.inflight += 1
        self.pending.append(rep)
        if len(self.pending) > self.k:
            self.pending.popleft().inflight -= 1
        self._serve(rep.id, self.hasher.hashes(toks))
        return d

    def _serve(self, rid: str, hashes: list[bytes]) -> None:
        cache = self.caches[rid]
        hit = next((i for i, h in enumerate(hashes) if h not in cache), len(hashes))
        self.hit_blocks += hit
        self.reusable_blocks += next(
            (i for i, h in enumerate(hashes) if h not in self.seen), len(hashes)
        )
        self.seen.update(hashes)
        new = [h for h in hashes if h not in cache]
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        evicted = [cache.popitem(last=False)[0] for _ in range(len(cache) - self.cache_blocks)]
        if isinstance(self.policy, KVEventsPolicy):
            self.seq[rid] += 1
            self.policy.index.apply(rid, batch(self.seq[rid], stored(new), removed(evicted)))

    @property
    def hit_rate(self) -> float:
        """Reused blocks out of those that some replica had computed before."""
        return self.hit_blocks / max(self.reusable_blocks, 1)

    @property
    def imbalance(self) -> float:
        counts = [self.routed[r.id] for r in self.replicas]
        return max(counts) / (sum(counts) / len(counts))


# ----------------------------------------------------------------------------- load-only


def test_replica_load_is_the_larger_view() -> None:
    assert Replica("a", inflight=3, running=1, waiting=1).load == 3
    assert Replica("a", inflight=1, running=2, waiting=4).load == 6


def test_round_robin_cycles_in_id_order_and_skips_unhealthy() -> None:
    policy = RoundRobinPolicy()
    reps = [Replica("c"), Replica("a"), Replica("b")]
    picks = [route(policy, [1], reps) for _ in range(6)]
    assert [d.replica_id for d in picks] == ["a", "b", "c", "a", "b", "c"]
    assert {d.reason for d in picks} == {"round_robin"}
    reps[2].healthy = False  # "b"
    assert [route(policy, [1], reps).replica_id for _ in range(4)] == ["a", "c", "a", "c"]


def test_least_load_picks_min_and_alternates_ties() -> None:
    policy = LeastLoadPolicy()
    assert route(policy, [1], replicas(3, 1, 2)).replica_id == "r1"
    tied = replicas(2, 0, 0, 5)
    picks = [route(policy, [1], tied).replica_id for _ in range(4)]
    assert picks == ["r2", "r1", "r2", "r1"]  # never always the first one
    assert route(policy, [1], tied).reason == "least_load"


@pytest.mark.parametrize("name", ROUTING_POLICIES.names())
def test_no_healthy_replica(name: str) -> None:
    policy = make_policy(name, block_size=BS)
    with pytest.raises(NoReplicaError, match="no healthy replica"):
        policy.choose(RouteRequest(tokens(0, 16)), [])
    with pytest.raises(NoReplicaError):
        policy.choose(RouteRequest(tokens(0, 16)), [Replica("a", healthy=False)])


# ----------------------------------------------------------------------------- prefix


@pytest.mark.parametrize("name", KV_AWARE)
def test_same_prompt_and_growing_conversation_stick(name: str) -> None:
    sim = Sim(make_policy(name, block_size=BS), n=3, k=4)
    first = sim.send(tokens(1, 40))
    assert first.reason == "miss" and first.total_blocks == 10
    assert first.block_hashes == tuple(BlockHasher(BS, "").hashes(tokens(1, 40)))
    again = sim.send(tokens(1, 40))
    assert again.replica_id == first.replica_id
    assert (again.reason, again.matched_blocks) == ("affinity", 10)
    convo = tokens(2, 30)
    home = sim.send(convo).replica_id
    for turn in range(3, 9):
        sim.send(tokens(100 + turn, 24))  # other traffic in between
        convo = convo + tokens(turn, 13)  # the next turn extends the previous prompt
        d = sim.send(convo)
        assert (d.replica_id, d.reason) == (home, "affinity")
        assert d.matched_blocks == (len(convo) - 13) // BS


@pytest.mark.parametrize("name", KV_AWARE)
def test_misses_spread_by_load(name: str) -> None:
    sim = Sim(make_policy(name, block_size=BS), n=4, k=8)
    for i in range(100):
        assert sim.send(tokens(1000 + i, 20)).reason == "miss"
    assert sim.imbalance <= 1.5
    assert max(sim.routed.values()) < 100


def test_miss_goes_by_load_not_by_cache() -> None:
    """sglang#14305: the idle replica holding a big cache must take the misses."""
    policy = make_policy("prefix", block_size=BS)
    reps = replicas(0, 0)
    route(policy, tokens(7, 64), reps)  # r0 now "caches" 16 blocks
    reps[0].inflight, reps[1].inflight = 0, 6
    assert route(policy, tokens(8, 64), reps) == Decision(
        "r0", "miss", 0, 16, tuple(BlockHasher(BS, "").hashes(tokens(8, 64)))
    )


@pytest.mark.parametrize(
    ("best_load", "other_load", "reason"),
    [
        (2, 0, "affinity"),  # 2 - 0 > 2 fails
        (3, 0, "balance"),  # 3 - 0 > 2 and 3 > 1.5 * 1
        (6, 4, "affinity"),  # 6 - 4 > 2 fails
        (7, 4, "balance"),  # 7 - 4 > 2 and 7 > 6
        (10, 7, "affinity"),  # 10 - 7 > 2 but 10 > 10.5 fails
        (11, 7, "balance"),  # 11 - 7 > 2 and 11 > 10.5
    ],
)
def test_balance_thresholds(best_load: int, other_load: int, reason: str) -> None:
    policy = make_policy("prefix", block_size=BS, balance=BalanceConfig(2, 1.5))
    prompt = tokens(3, 32)
    reps = [Replica("a"), Replica("b")]
    assert route(policy, prompt, reps).replica_id == "a"
    reps[0].running, reps[0].waiting, reps[1].inflight = best_load - 1, 1, other_load
    d = policy.choose(RouteRequest(prompt), reps)
    assert d.reason == reason
    assert d.replica_id == ("a" if reason == "affinity" else "b")
    assert d.matched_blocks == (8 if reason == "affinity" else 0) and d.total_blocks == 8


def test_min_match_ratio_and_short_prompts() -> None:
    policy = make_policy("prefix", block_size=BS, balance=BalanceConfig(min_match_ratio=0.5))
    reps = replicas(0, 0)
    route(policy, tokens(4, 8), reps)  # r0 holds the first 2 blocks of the prompts below
    quarter = tokens(4, 8) + tokens(5, 24)
    assert policy.choose(RouteRequest(quarter), reps).reason == "miss"  # 2 / 8 < 0.5
    half = tokens(4, 8) + tokens(6, 8)
    assert policy.choose(RouteRequest(half), reps).reason == "affinity"  # 2 / 4
    short = [route(policy, [1, 2, 3], reps) for _ in range(4)]  # no full block: a miss
    assert [d.reason for d in short] == ["miss"] * 4 and short[0].total_blocks == 0
    assert len({d.replica_id for d in short}) == 2


@pytest.mark.parametrize(
    "kwargs",
    [{"balance_abs": -1}, {"balance_rel": 0.9}, {"min_match_ratio": -0.1}, {"min_match_ratio": 2}],
)
def test_balance_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        BalanceConfig(**kwargs)


def test_make_policy() -> None:
    classes = [RoundRobinPolicy, LeastLoadPolicy, PrefixPolicy, KVEventsPolicy]
    for name, cls in zip(ROUTING_POLICIES.names(), classes, strict=True):
        policy = make_policy(name)
        assert type(policy) is cls and policy.name == name
        assert ROUTING_POLICIES.get(name) is cls and cls.kv_aware == (name in KV_AWARE)
    with pytest.raises(ConfigError, match=r"'cache'.*round_robin, least_load, prefix, kv_events"):
        make_policy("cache")
    with pytest.raises(ConfigError, match="block size"):
        make_policy("prefix", block_size=0)
    with pytest.raises(ConfigError, match="capacity"):
        make_policy("kv_events", capacity_blocks=0)


# ----------------------------------------------------------------------------- indexes


def test_block_hasher_is_the_engine_chain() -> None:
    toks = tokens(9, 18)
    hasher = BlockHasher(BS, "m")
    assert hasher.hashes(toks) == hash_blocks(toks, BS, root_hash("m"))
    assert len(hasher.hashes(toks)) == 4  # the partial tail block has no hash
    assert hasher.hashes(toks, "salt") != hasher.hashes(toks)
    assert BlockHasher(BS, "other").hashes(toks) != hasher.hashes(toks)


def test_approx_index_lru_capacity() -> None:
    index = ApproxPrefixIndex(capacity_blocks=4)
    a, b = BlockHasher(BS, "").hashes(tokens(10, 12)), BlockHasher(BS, "").hashes(tokens(11, 12))
    index.record("r", a)
    assert index.match("r", a) == 3 and index.match("other", a) == 0
    index.record("r", b)  # 6 > 4: a's tail goes first, its head survives longest
    index.check_integrity()
    assert index.num_blocks("r") == 4
    assert (index.match("r", a), index.match("r", b)) == (1, 3)
    index.record("r", a)  # refreshes a; b's tail is now the oldest
    assert (index.match("r", a), index.match("r", b)) == (3, 1)
    index.remove_replica("r")
    assert index.match("r", a) == 0
    index.check_integrity()


def test_event_index_stored_removed_cleared_and_mediums() -> None:
    h = BlockHasher(BS, "").hashes(tokens(12, 16))
    index = EventIndex()
    index.apply("r", batch(5, stored(h)))  # before the first snapshot: ignored
    assert not index.is_fresh("r") and index.match("r", h) == 0
    index.apply("r", batch(7, snap(h[:2]), snap(h, "redis"), snapshot=True))
    assert index.is_fresh("r") and index.match("r", h) == 2  # redis never counts
    index.apply("r", batch(8, stored(h[2:3], "host")))
    assert index.match("r", h) == 3  # union of device and host
    index.apply("r", batch(9, removed(h[:1])))
    assert index.match("r", h) == 0
    index.apply("r", batch(10, stored(h[:1]), {"type": "AllBlocksCleared", "medium": "host"}))
    assert index.match("r", h) == 2 and index.num_blocks("r", "redis") == 4
    index.check_integrity()
    index.apply("r", batch(12, stored(h)))  # gap: stale, ignored until a snapshot
    assert not index.is_fresh("r") and index.match("r", h) == 0
    index.apply("r", batch(13, stored(h)))
    assert not index.is_fresh("r")
    index.check_integrity()
    index.apply("r", batch(40, snap(h), snapshot=True))
    assert index.match("r", h) == 4
    index.mark_stale("r")
    assert index.match("r", h) == 0
    index.remove_replica("r")
    index.check_integrity()


BAD_BATCHES: list[Any] = [
    ["not", "a", "batch"],
    {"events": []},
    {"seq": "9", "events": []},
    {"seq": True, "events": []},
    {"seq": 9, "snapshot": "no", "events": []},
    {"seq": 9, "events": {}},
    {"seq": 9, "events": ["BlockStored"]},
    {"seq": 9, "events": [{"block_hashes": []}]},
    {"seq": 9, "events": [{"type": "BlockMoved", "block_hashes": []}]},
    {"seq": 9, "events": [{"type": "BlockStored", "block_hashes": ["zz"]}]},
    {"seq": 9, "events": [{"type": "BlockStored", "block_hashes": ["00ff"]}]},
    {"seq": 9, "events": [{"type": "BlockRemoved", "block_hashes": [17]}]},
    {"seq": 9, "events": [{"type": "BlockRemoved"}]},
    {"seq": 9, "events": [{"type": "BlockSnapshot", "block_hashes": "00"}]},
    {"seq": 9, "events": [{"type": "AllBlocksCleared", "medium": 3}]},
]


@pytest.mark.parametrize("bad", BAD_BATCHES)
def test_event_index_malformed_batches_do_not_raise(
    bad: Any, caplog: pytest.LogCaptureFixture
) -> None:
    h = BlockHasher(BS, "").hashes(tokens(13, 8))
    index = EventIndex()
    index.apply("r", batch(8, snap(h), snapshot=True))
    with caplog.at_level(logging.WARNING, logger="kvstack.route"):
        index.apply("r", bad)
        index.apply("r", batch(10, stored(h)))  # stale now: ignored quietly
    assert [r.name for r in caplog.records] == ["kvstack.route"]
    assert not index.is_fresh("r") and index.match("r", h) == 0
    index.check_integrity()
    if isinstance(bad, dict) and "seq" in bad and "snapshot" not in bad:  # now in a snapshot
        index.apply("r", {**bad, "snapshot": True})
        assert not index.is_fresh("r")
    index.apply("r", batch(20, snap(h), snapshot=True))
    assert index.match("r", h) == 2
    index.check_integrity()


def test_kv_events_exact_then_stale_fallback_then_precise_again() -> None:
    policy = make_policy("kv_events", block_size=BS)
    assert isinstance(policy, KVEventsPolicy)
    reps = [Replica("a"), Replica("b")]
    for rid in ("a", "b"):
        policy.index.apply(rid, batch(1, snap([]), snapshot=True))
    prompt = tokens(14, 32)
    h = BlockHasher(BS, "").hashes(prompt)
    assert route(policy, prompt, reps).replica_id == "a"  # a miss, recorded for a
    d = policy.choose(RouteRequest(prompt), reps)  # not announced yet, but just routed there
    assert (d.replica_id, d.reason) == ("a", "affinity")
    policy.recent.remove_replica("a")  # once out of the recent window: the events decide
    assert policy.choose(RouteRequest(prompt), reps).reason == "miss"  # events know nothing
    policy.index.apply("b", batch(2, stored(h)))  # b reports the blocks (another router)
    d = route(policy, prompt, reps)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("b", "affinity", 8)
    policy.index.apply("a", batch(3, stored(h)))  # a skipped seq 2: stale, approximate
    assert not policy.index.is_fresh("a")
    reps[1].inflight = 1
    d = route(policy, prompt, reps)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("a", "affinity", 8)
    policy.index.apply("a", batch(50, snap([]), snapshot=True))  # precise again: a has none
    policy.recent.remove_replica("a")  # (and the last route to a is out of the recent window)
    d = route(policy, prompt, reps)
    assert (d.replica_id, d.reason) == ("b", "affinity")
    policy.remove_replica("a")
    assert policy.index.match("a", h) == policy.approx.match("a", h) == 0
    policy.check_integrity()


# ----------------------------------------------------------------------------- workload


def multi_turn(sim: Sim, sessions: int = 20, turns: int = 4) -> None:
    """Sessions share a system prompt; each turn extends its session's last prompt."""
    rng = random.Random(0)
    system = tokens(42, 32)
    convos = {s: system + tokens(s, 16) for s in range(sessions)}
    for turn in range(turns):
        order = list(convos)
        rng.shuffle(order)
        for s in order:
            sim.send(convos[s])
            convos[s] = convos[s] + tokens(1000 * turn + s, 40)


def test_simulated_multi_turn_hit_rate() -> None:
    """2 replicas, 20 sessions x 4 turns: affinity keeps each session's history where it
    was computed (round-robin loses it half of the time), with the load still even."""
    rates = {}
    for name in ROUTING_POLICIES.names():
        sim = Sim(make_policy(name, block_size=BS), n=2, k=6, cache_blocks=400)
        multi_turn(sim)
        assert sim.imbalance <= 1.5, (name, sim.routed)
        rates[name] = sim.hit_rate
        if isinstance(sim.policy, KVEventsPolicy):  # it routed on the events throughout
            assert all(sim.policy.index.is_fresh(r.id) for r in sim)
    assert rates["prefix"] >= 0.9 and rates["kv_events"] >= 0.9, rates
    assert rates["prefix"] > rates["round_robin"] + 0.15, rates
    assert rates["kv_events"] > rates["round_robin"] + 0.15, rates
