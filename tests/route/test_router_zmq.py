"""``kvstack router --policy kv_events`` on vLLM's ZMQ wire: KVEventBatch msgpack from each
backend's PUB socket, gaps filled from its ROUTER replay socket, vLLM's block hashes.

* batches recorded from vLLM 0.32 itself (``scripts/record_vllm_kv_events.py`` drove
  vLLM's ``BlockPool`` and ``ZmqEventPublisher``; ``data/vllm_kv_events.json``) are
  indexed, and the router's own recomputation of vLLM's hashes matches them;
* batches encoded with vLLM's struct layout by an independent msgspec codec
  (``tests/vllm_wire.py``): int hashes, gaps, replays, a publisher that dies or restarts;
* two real ``kvstack serve`` replicas publishing ZMQ: a long prefix one of them holds
  (sent to it behind the router's back) is routed to it;
* a bad ``--kv-events-endpoint`` is one line and exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstack.cli import main
from kvstack.route.policy import BalanceConfig, KVEventsPolicy, Replica, RouteRequest
from kvstack.route.policy.kv_index import BlockHasher
from kvstack.route.policy.vllm_events import MalformedBatchError, decode_batch
from kvstack.route.policy.vllm_index import RequestHashes, VllmEventIndex
from kvstack.route.router.event_sources import EventEndpoints
from kvstack.route.router.events_zmq import ZmqEndpoint, ZmqEventFollower
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder
from router_util import BgLoop, RouterUnderTest, free_port, wait_until
from server_util import ServerProcess
from vllm_wire import DECODER, ENCODER, BlockRemoved, BlockStored, FakePublisher, KVEventBatch

DATA = json.loads((Path(__file__).parent / "data" / "vllm_kv_events.json").read_text())
BS = 16


def hashes(
    algo: str, ids: list[int], salt: str | None = None, ints: bool = False
) -> tuple[bytes, ...]:
    """What the router computes for a prompt (``RequestHashes``, vLLM's keyspace; an int
    hash keyed as its 8 bytes)."""
    return RequestHashes(RouteRequest(ids, salt), BlockHasher(BS, ""), algo).vllm(BS, ints)


async def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """A hang guard, not a timing assertion: wait for ``pred`` on the running loop."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def follow(
    pub: FakePublisher, index: VllmEventIndex, probe_s: float | None = None
) -> ZmqEventFollower:
    """A follower of ``pub``; no idle probe unless asked (the tests count every replay)."""
    ep = ZmqEndpoint(pub.endpoint, pub.replay_endpoint)
    return ZmqEventFollower("r", ep, index, topic="kv", replay_timeout_s=2.0, probe_s=probe_s)


def stored(ids: list[int], algo: str = "sha256") -> bytes:
    hs = list(hashes(algo, ids))
    ev = BlockStored(hs, None, ids, BS, None, "GPU", None, [None] * len(hs), 0)
    return ENCODER.encode(KVEventBatch(time.time(), [ev], 0))


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 60))


@pytest.mark.parametrize("run_", DATA["runs"], ids=lambda r: r["algo"])
def test_batches_recorded_from_vllm_are_indexed_under_recomputed_hashes(
    run_: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # vLLM recorded with its fixed seed
    algo, frames = run_["algo"], run_["frames"]
    a, c, salt = DATA["prompts"]["A"], DATA["prompts"]["C"], DATA["salt"]
    assert DATA["block_size"] == BS and [f["seq"] for f in frames] == list(range(6))
    payloads = [bytes.fromhex(f["payload"]) for f in frames]
    first = DECODER.decode(payloads[0])  # vLLM 0.32's layout, as the independent codec reads it
    salted = next(e for e in first.events if isinstance(e, BlockStored) and e.extra_keys[0])
    assert salted.extra_keys == [(salt,), None, None] and salted.group_idx == 0
    # vLLM 0.32 publishes the low 64 bits as ints by default (VLLM_KV_EVENTS_USE_INT_...).
    want_ints = [int.from_bytes(h, "big") for h in hashes(algo, a, salt, ints=True)]
    assert list(salted.block_hashes) == want_ints  # vLLM's = recomputed
    want = {  # after each batch: leading blocks held of A, A salted, C
        0: (3, 3, 2), 1: (3, 3, 3), 2: (0, 0, 0), 3: (3, 0, 2), 4: (0, 0, 0), 5: (2, 0, 3),
    }  # fmt: skip

    async def go() -> None:
        pub, index = FakePublisher(DATA["topic"]), VllmEventIndex()
        pub.send(0, payloads[0])  # before the router subscribes: it comes by replay
        pub.settle()
        f = follow(pub, index)
        f.start()
        try:
            await until(lambda: f.counts["batches"] == 1 and f.fresh, "the replay of batch 0")
            assert f.counts["replayed_batches"] == 1 and pub.replays == [0]
            await until(pub.subscribed.is_set, "the subscription")
            for seq, payload in enumerate(payloads):
                if seq:
                    pub.send(seq, payload)
                await until(lambda s=seq: f.counts["batches"] == s + 1, f"batch {seq}")
                got = tuple(
                    index.match("r", hashes(algo, ids, s, ints=True))
                    for ids, s in ((a, None), (a, salt), (c, None))
                )
                assert got == want[seq], seq
            assert index.keyspace("r") == (BS, True) and f.counts["malformed"] == 0
            index.check_integrity()
        finally:
            await f.stop()
            pub.close()

    run(go)


def test_int_hashes_legacy_arrays_and_malformed_payloads() -> None:
    ids = list(range(7, 7 + 48))
    ints = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes("sha256", ids)]
    batch = KVEventBatch(1.0, [BlockStored(ints, None, ids, BS, None, "GPU", None)])
    decoded = decode_batch(ENCODER.encode(batch))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1
    index = VllmEventIndex()
    index.resume("r")
    index.apply("r", decoded.events)
    keys = RequestHashes(RouteRequest(ids), BlockHasher(BS, ""), "sha256")
    assert index.keyspace("r") == (BS, True) and index.match("r", keys.vllm(BS, True)) == 3
    index.apply(
        "r", decode_batch(ENCODER.encode(KVEventBatch(2.0, [BlockRemoved(ints[1:], None)]))).events
    )
    assert index.match("r", keys.vllm(BS, True)) == 1
    # Earlier vLLM releases encoded events array_like: ["BlockStored", hashes, parent, ...].
    import msgpack

    legacy = msgpack.packb([3.0, [["BlockStored", ints[1:], ints[0], ids[16:], BS, None, "GPU"]]])
    index.apply("r", decode_batch(legacy).events)
    assert index.match("r", keys.vllm(BS, True)) == 3
    bad_events: list[Any] = [
        {"type": "Nope"},
        {"type": "BlockRemoved", "block_hashes": ["x"]},
        {"type": "BlockStored", "block_hashes": [], "block_size": 0},
        ["BlockRemoved", [b"h"], "GPU", 0, "extra"],
    ]
    bad = [b"\xc1", msgpack.packb({"ts": 1})] + [msgpack.packb([1.0, [e]]) for e in bad_events]
    for payload in bad:
        with pytest.raises(MalformedBatchError):
            decode_batch(payload)


def test_a_gap_is_replayed_and_an_unfillable_gap_empties_the_view() -> None:
    x, y, z, w = ([base + i for i in range(32)] for base in (100, 200, 300, 400))

    async def go() -> None:
        pub, index = FakePublisher(), VllmEventIndex()
        f = follow(pub, index)
        f.start()
        try:
            await until(lambda: f.fresh and pub.subscribed.is_set(), "connected")
            pub.send(0, stored(x))
            await until(lambda: f.counts["batches"] == 1, "batch 0")
            pub.send(1, stored(y), skip=True)  # missed by the SUB, kept by the replay
            pub.send(2, stored(z))
            await until(lambda: f.counts["batches"] == 3, "the gap filled")
            assert f.counts["gaps_filled"] == 1 and 1 in pub.replays
            assert [index.match("r", hashes("sha256", p)) for p in (x, y, z)] == [2, 2, 2]
            pub.send(3, stored(w), skip=True)
            pub.forget(3)  # evicted from the replay buffer: the loss cannot be repaired
            pub.settle()
            pub.send(4, stored(w))
            await until(lambda: f.counts["gaps_unfilled"] == 1, "the unfillable gap")
            await until(lambda: f.next_seq == 5, "batch 4")
            assert [index.match("r", hashes("sha256", p)) for p in (x, y, z, w)] == [0, 0, 0, 2]
        finally:
            await f.stop()
            pub.close()

    run(go)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short directory for ipc:// sockets (a unix socket path has at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvz-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_dead_publisher_degrades_to_the_fallback_and_a_restart_resyncs(ipc_dir: Path) -> None:
    p = list(range(500, 564))
    policy = KVEventsPolicy(BlockHasher(BS, ""), BalanceConfig(), recent_blocks=1)
    replicas = [Replica("a"), Replica("b")]
    ends = (f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay")

    async def go() -> None:
        pub = FakePublisher(endpoints=ends)
        f = ZmqEventFollower("b", ZmqEndpoint(*ends), policy.vllm_index, probe_s=None)
        never = ZmqEventFollower("a", ZmqEndpoint(f"tcp://127.0.0.1:{free_port()}"),
                                 policy.vllm_index)  # fmt: skip
        f.start()
        never.start()
        try:
            await until(lambda: f.fresh and pub.subscribed.is_set(), "connected")
            pub.send(0, stored(p))
            await until(lambda: f.counts["batches"] == 1, "batch 0")
            d = policy.choose(RouteRequest(p), replicas)
            assert (d.replica_id, d.reason, d.matched_blocks) == ("b", "affinity", 4)
            assert not never.fresh and not never.connected  # nobody there: approximate
            pub.close()  # the publisher dies
            await until(lambda: not f.fresh, "stale after the disconnect")
            d = policy.choose(RouteRequest(p), replicas)  # approximate: nothing recorded
            assert d.reason == "miss" and d.matched_blocks == 0
            pub = FakePublisher(endpoints=ends)  # restarted: numbering from 0 again
            await until(lambda: f.fresh and f.counts["connects"] == 2, "reconnected")
            await until(pub.subscribed.is_set, "the new subscription")
            pub.send(0, stored(p[:32]))
            await until(lambda: f.counts["restarts"] == 1 and f.next_seq == 1, "the restart")
            d = policy.choose(RouteRequest(p), replicas)
            assert (d.replica_id, d.matched_blocks) == ("b", 2)  # the old view was dropped
            policy.check_integrity()
        finally:
            await asyncio.wait_for(f.stop(), 5)
            await asyncio.wait_for(never.stop(), 5)
            pub.close()

    run(go)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-events-endpoint", "nonsense"], "wants BACKEND=tcp://HOST:PORT"),
        (["--kv-events-endpoint", "http://127.0.0.1:1="], "wants BACKEND="),
        (["--kv-events-endpoint", "http://127.0.0.1:1=localhost:5557"], "is not tcp://"),
        (["--kv-events-endpoint", "http://127.0.0.1:1=tcp://*:5557"], "is a bind address"),
        (["--kv-events-endpoint", "http://127.0.0.1:1=tcp://h:99999"], "tcp://h:99999"),
        (["--kv-events-endpoint", "http://127.0.0.1:2=tcp://h:1"], "is not a --backend"),
        (["--kv-events-endpoint", "ftp://h:1=tcp://h:1"], "malformed backend URL"),
        (["--kv-events-port", "55x"], "--kv-events-port wants"),
        (["--kv-events-port", "1", "--policy", "prefix"], "need --policy kv_events"),
        (["--kv-events-port", "1", "--prefix-caching-hash-algo", "xxhash"], "PYTHONHASHSEED"),
    ],
)
def test_bad_kv_events_flags_are_one_line_and_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert main(["router", "--backend", "http://127.0.0.1:1", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_kv_events_port_covers_discovered_backends() -> None:
    ends = EventEndpoints.parse(["http://10.0.0.5:8000=tcp://10.0.0.9:7000"], "5557,5558")
    assert ends.for_backend("http://10.0.0.5:8000") == ZmqEndpoint("tcp://10.0.0.9:7000")
    assert ends.for_backend("http://10.0.0.6:8000") == ZmqEndpoint(
        "tcp://10.0.0.6:5557", "tcp://10.0.0.6:5558"
    )
    assert ends.for_backend("http://[fd00::1]:8000") == ZmqEndpoint(
        "tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558"
    )
    assert EventEndpoints().kind("http://10.0.0.6:8000") == "sse"


def test_router_sends_a_prefix_to_the_real_replica_whose_zmq_events_hold_it(
    bg: BgLoop, tmp_path: Path, ipc_dir: Path
) -> None:
    cfg = tiny_llama_config()
    model = write_hf_folder(tmp_path / "hf", cfg, random_llama_weights(cfg))
    ends = {n: ZmqEndpoint(f"ipc://{ipc_dir}/{n}.pub", f"ipc://{ipc_dir}/{n}.replay")
            for n in "ab"}  # fmt: skip

    def server(n: str) -> ServerProcess:
        kv = {"enable_kv_cache_events": True, "endpoint": ends[n].endpoint,
              "replay_endpoint": ends[n].replay_endpoint}  # fmt: skip
        args = [str(model), "--dtype", "float32", "--num-blocks", "128", "--block-size",
                str(BS), "--kv-events-config", json.dumps(kv)]  # fmt: skip
        return ServerProcess(args, tmp_path / f"{n}.log")

    a, b = server("a"), server("b")
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as ex:
        for srv in (a, b):
            stack.callback(lambda s=srv: s.proc is not None and s.stop())
        list(ex.map(ServerProcess.__enter__, (a, b)))  # both load at once
        endpoints = EventEndpoints({a.url: ends["a"], b.url: ends["b"]})
        router = RouterUnderTest(bg, [a.url, b.url], policy="kv_events", event_endpoints=endpoints)
        try:
            router.wait_healthy(2, timeout=30)
            wait_until(lambda: all(r["events"]["fresh"] for r in router.state()["replicas"]),
                       30, "both ZMQ followers fresh")  # fmt: skip
            for srv, base in ((b, 100), (a, 200)):  # (the tiny model's vocabulary is 320)
                prefix = [base + i for i in range(96)]  # six blocks
                body = {"prompt": prefix, "max_tokens": 1}
                before = router.replica(srv.url)["events"]["batches"]
                httpx.post(srv.url + "/v1/completions", json=body, timeout=60).raise_for_status()
                wait_until(lambda s=srv, n=before: router.replica(s.url)["events"]["batches"] > n,
                           30, "the replica's BlockStored")  # fmt: skip
                for k in range(3):  # the router never sent this prefix anywhere
                    r = router.complete([*prefix, 7, 8, 9, k], max_tokens=1)
                    r.raise_for_status()
                    route = (r.headers["x-kvstack-replica"], r.headers["x-kvstack-route"])
                    assert route == (srv.url, "affinity"), (k, route)
            r = router.complete([1 + i for i in range(64)], max_tokens=1)
            assert r.headers["x-kvstack-route"] == "miss"
            for rep in router.state()["replicas"]:
                ev = rep["events"]
                assert ev["source"] == "zmq" and ev["malformed"] == 0 and ev["gaps_unfilled"] == 0
                assert (ev["block_size"], ev["int_hashes"]) == (BS, True)  # vLLM's default
                assert ev["blocks"] >= 6
        finally:
            router.stop()
