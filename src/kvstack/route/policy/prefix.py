"""KV-aware policies: ``prefix`` and ``kv_events`` send a request where its prefix is cached.

They hash the prompt into the engine's block chain (``kv_index.BlockHasher``), ask an
index how many leading blocks each healthy replica already caches, and apply one rule:

1. ``best`` = the longest match (ties: least load, then round-robin rotation).
2. *miss*: ``best`` matches nothing, or less than ``min_match_ratio`` of the request's
   blocks → the least loaded replica (ties: round-robin rotation).
3. *balance*: ``load(best) - min_load > balance_abs`` and ``load(best) > balance_rel ·
   max(min_load, 1)`` → the least loaded replica: the cache is worth less than a queue.
4. otherwise *affinity* → ``best``.

Example (``balance_abs=2``, ``balance_rel=1.5``, a 4-block request)::

    request blocks:        h0 h1 h2 h3     (system prompt h0 h1, user turn h2 h3)
    replica A (load 3):    h0 h1 h2        match 3   <- best
    replica B (load 1):    h0              match 1
    replica C (load 0):                    match 0
    3 - 0 > 2 and 3 > 1.5 · max(0, 1)  -> "balance": C
    with load(A) = 2 instead: 2 - 0 > 2 fails  -> "affinity": A

This is SGLang's cache-aware router (``balance_abs_threshold`` /
``balance_rel_threshold``), with one difference that matters: a miss goes by *load*,
never by cache size. sgl-project/sglang#14305 ("death spiral") sent every miss to the
worker with the smallest radix tree, which is the one busy with unique heavy requests,
so 100 % of new traffic piled onto it while a peer sat idle; sglang#32983 saw a fixed
tie-break pick replica 0 for every miss at low concurrency. Here a miss goes to the least
loaded replica and equal loads rotate, so consecutive misses alternate by construction.

Where the matches come from:

* ``prefix``: approximate, like the Gateway API Inference Extension's prefix-cache scorer
  and Ray Serve's ``PrefixCacheAffinityRouter``: a router-side LRU of the block hashes the
  router itself sent to each replica (``ApproxPrefixIndex``).
* ``kv_events``: precise, like llm-d's KV-cache indexer fed by vLLM KV events: the
  replicas' own event streams, kvstack's SSE stream (``EventIndex``, kvstack's hashes)
  or a ZMQ PUB socket on vLLM's wire (``VllmEventIndex``, the publisher's hashes,
  recomputed per request by ``RequestHashes``); a replica whose stream is stale falls
  back to the approximate index, which keeps being recorded, so degrading is seamless.
  Matches are counted in the router's blocks (``BlockHasher.block_size``): a ZMQ
  replica's match in its own block size is converted by tokens. On kvstack's SSE stream a
  replica also announces its segment entries (tool schemas, documents), so a
  request whose segments a replica holds after its matched prefix gets those tokens
  credited as blocks (``KVEventsPolicy.segment_blocks``).
"""

from __future__ import annotations

from kvstack.route.policy.base import (
    BalanceConfig,
    Decision,
    Replica,
    RouteRequest,
    RoutingPolicy,
)
from kvstack.route.policy.kv_index import ApproxPrefixIndex, BlockHasher, EventIndex
from kvstack.route.policy.vllm_index import RequestHashes, VllmEventIndex


class PrefixPolicy(RoutingPolicy):
    """Cache affinity on the approximate index of hashes the router sent (Gateway API
    Inference Extension prefix scorer, Ray Serve ``PrefixCacheAffinityRouter``), guarded
    by ``BalanceConfig``. ``on_routed`` records the request's hashes for the chosen replica.
    """

    name = "prefix"
    kv_aware = True

    def __init__(
        self,
        hasher: BlockHasher,
        balance: BalanceConfig | None = None,
        capacity_blocks: int = 65536,
        hash_algo: str = "sha256",
    ) -> None:
        super().__init__()
        self.hasher = hasher
        self.hash_algo = hash_algo
        self.balance = balance if balance is not None else BalanceConfig()
        self.approx = ApproxPrefixIndex(capacity_blocks)

    @classmethod
    def create(
        cls, *, block_size: int, model_id: str, balance: BalanceConfig | None,
        capacity_blocks: int, hash_algo: str = "sha256",
    ) -> RoutingPolicy:  # fmt: skip
        return cls(BlockHasher(block_size, model_id), balance, capacity_blocks, hash_algo)

    def match(self, replica_id: str, keys: RequestHashes) -> int:
        """Leading blocks of the request the replica is believed to cache."""
        return self.approx.match(replica_id, keys.kvstack)

    def _choose(self, req: RouteRequest, healthy: list[Replica]) -> Decision:
        keys = RequestHashes(req, self.hasher, self.hash_algo)
        hashes = keys.kvstack
        total = len(hashes)
        matches = {r.id: self.match(r.id, keys) for r in healthy} if total else {}
        best_len = max(matches.values(), default=0)
        cfg = self.balance

        def decide(replica: Replica, reason: str) -> Decision:
            return Decision(replica.id, reason, matches.get(replica.id, 0), total, hashes)

        if best_len == 0 or best_len < cfg.min_match_ratio * total:
            return decide(self._least_loaded(healthy), "miss")
        longest = [r for r in healthy if matches[r.id] == best_len]
        best = self._least_loaded(longest)
        min_load = min(r.load for r in healthy)
        if best.load - min_load > cfg.balance_abs and best.load > cfg.balance_rel * max(
            min_load, 1
        ):
            return decide(self._least_loaded(healthy), "balance")
        return decide(best, "affinity")

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        self.approx.record(decision.replica_id, decision.block_hashes)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.approx.remove_replica(replica_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.approx.check_integrity()


class KVEventsPolicy(PrefixPolicy):
    """Cache affinity on the replicas' own KV events (llm-d's KV-cache indexer): matches
    come from ``vllm_index`` (ZMQ) or ``index`` (SSE) for fresh replicas and from the
    approximate index (still recorded by ``on_routed``) for stale ones. The router feeds
    ``index.apply`` from each replica's ``GET /v1/kv_events`` stream, ``vllm_index``
    from its ZMQ PUB socket, and marks a replica stale when its stream drops."""

    name = "kv_events"

    def __init__(
        self,
        hasher: BlockHasher,
        balance: BalanceConfig | None = None,
        capacity_blocks: int = 65536,
        hash_algo: str = "sha256",
        recent_blocks: int = 256,
    ) -> None:
        super().__init__(hasher, balance, capacity_blocks, hash_algo)
        self.index = EventIndex()
        self.vllm_index = VllmEventIndex()
        # Events trail the routing by a step plus the stream's poll interval: a burst of
        # requests with one new prefix would all be misses (and spread) before the first
        # replica announces the blocks. The last ``recent_blocks`` hashes routed to a
        # replica count as held there too, so a burst follows its first request.
        self.recent = ApproxPrefixIndex(recent_blocks)

    def match(self, replica_id: str, keys: RequestHashes) -> int:
        hashes = keys.kvstack
        space = self.vllm_index.keyspace(replica_id)
        if space is not None:  # a ZMQ replica: its own hashes, its own block size
            n = self.vllm_index.match(replica_id, keys.vllm(*space))
            exact = n * space[0] // self.hasher.block_size
        elif self.index.is_fresh(replica_id) or self.vllm_index.is_fresh(replica_id):
            exact = self.index.match(replica_id, hashes)  # (a fresh ZMQ view with no block: 0)
        else:
            return self.approx.match(replica_id, hashes)
        n = max(exact, self.recent.match(replica_id, hashes))
        return min(len(hashes), n + self.segment_blocks(replica_id, keys, n))

    def segment_blocks(self, replica_id: str, keys: RequestHashes, matched: int) -> int:
        """The request's segments after its ``matched`` leading blocks that the replica's
        event stream says it holds as segment entries, in whole blocks: a held
        segment is copied instead of computed, so it counts like cached blocks (its repair
        rows, ~15 % of it, are not subtracted). 0 without segments or a fresh SSE view
        (vLLM's ZMQ wire has no segment events)."""
        req = keys.req
        if not req.segments or not self.index.is_fresh(replica_id):
            return 0
        start = matched * self.hasher.block_size
        held = self.index.segments_held(replica_id, keys.segment_keys())
        spans = zip(req.segments, held, strict=True)
        tokens = sum(m[1] - max(m[0], start) for m, h in spans if h and m[1] > start)
        return tokens // self.hasher.block_size

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        super().on_routed(req, decision)
        self.recent.record(decision.replica_id, decision.block_hashes)

    def remove_replica(self, replica_id: str) -> None:
        super().remove_replica(replica_id)
        self.index.remove_replica(replica_id)
        self.vllm_index.remove_replica(replica_id)
        self.recent.remove_replica(replica_id)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.index.check_integrity()
        self.vllm_index.check_integrity()
        self.recent.check_integrity()
