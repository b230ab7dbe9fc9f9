"""Offload tiers without a model: block format, spec parsing, host/disk/Redis tiers,
their budgets and every fault a tier must survive (corrupt and truncated files, a full disk,
Redis killed, paused and restarted), and the I/O thread's queue."""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvstack.config.engine import CacheConfig
from kvstack.core.errors import ConfigError
from kvstack.kv.tiers.block_format import (
    HEADER_SIZE,
    BlockLayout,
    CorruptBlockError,
    decode,
    encode,
)
from kvstack.kv.tiers.disk import DiskTier
from kvstack.kv.tiers.host import HostTier
from kvstack.kv.tiers.manager import OffloadManager
from kvstack.kv.tiers.redis_tier import RedisTier
from kvstack.kv.tiers.spec import parse_offload_spec
from kvstack.testing.redis_server import LocalRedis

LAYOUT = BlockLayout("model-a", "bfloat16", 4, 2, 1, 8, 2)  # payload 2*2*4*1*8*2 = 256 B
OTHER_DTYPE = BlockLayout("model-a", "float32", 4, 2, 1, 8, 4)
OTHER_MODEL = BlockLayout("model-b", "bfloat16", 4, 2, 1, 8, 2)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int, layout: BlockLayout = LAYOUT) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(layout.payload_bytes))


# ---------------------------------------------------------------------- block format
def test_block_format_round_trip_and_every_corruption() -> None:
    assert LAYOUT.payload_bytes == 256
    data = encode(LAYOUT, h(1), payload(1))
    assert len(data) == HEADER_SIZE + 256
    assert decode(LAYOUT, h(1), data) == payload(1)
    flipped = bytearray(data)
    flipped[HEADER_SIZE + 100] ^= 0x01
    cases = {
        "truncated": data[:-1],
        "header only": data[:HEADER_SIZE],
        "empty": b"",
        "flipped payload bit": bytes(flipped),
        "bad magic": b"XXXX" + data[4:],
    }
    for name, bad in cases.items():
        with pytest.raises(CorruptBlockError):
            decode(LAYOUT, h(1), bad)
        assert name
    with pytest.raises(CorruptBlockError, match="another prefix hash"):
        decode(LAYOUT, h(2), data)
    grouped = replace(LAYOUT, kv_groups="full:1;8:0")  # the hybrid manager's page order
    for other in (OTHER_DTYPE, OTHER_MODEL, grouped):
        assert other.namespace != LAYOUT.namespace
        with pytest.raises(CorruptBlockError, match="another model"):
            decode(other, h(1), data)
    with pytest.raises(ValueError):
        encode(LAYOUT, h(1), b"short")


# ---------------------------------------------------------------------- spec
def test_spec_parsing() -> None:
    specs = parse_offload_spec("host:2GiB,disk:/tmp/a:b:20GiB:lfu,redis://127.0.0.1:6390/2?ttl=60")
    assert [s.kind for s in specs] == ["host", "disk", "redis"]
    assert specs[0].capacity_bytes == 2 * 2**30 and specs[0].policy == "lru"
    assert specs[1].path == "/tmp/a:b" and specs[1].policy == "lfu"
    assert specs[2].ttl_s == 60 and specs[2].timeout_s == 0.25
    assert parse_offload_spec(None) == [] and parse_offload_spec("") == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ram:2GiB", "a tier is host:SIZE"),
        ("host:lots", "cannot parse memory size"),
        ("host", "expected a size"),
        ("host:1GiB,host:2GiB", "given twice"),
        ("disk:/tmp/x", "expected disk:PATH:SIZE"),
        ("disk::1GiB", "expected disk:PATH:SIZE"),
        ("redis://:6379", "no host"),
        ("redis://127.0.0.1:99999", "(?i)port out of range"),
        ("redis://127.0.0.1:6379?size=3", "unknown option"),
        ("redis://127.0.0.1:6379?ttl=-1", "must be positive"),
        ("redis://127.0.0.1:6379/abc", "database number"),
        ("host:1GiB,", "empty tier"),
    ],
)
def test_bad_specs_get_one_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_offload_spec(spec)
    with pytest.raises(ConfigError, match="--kv-offload"):
        CacheConfig(kv_offload=spec)


def test_offload_needs_a_prefix_cache_and_paged_layout() -> None:
    with pytest.raises(ConfigError, match="needs the paged layout and a prefix cache"):
        CacheConfig(kv_offload="host:1GiB", prefix_cache="none")
    with pytest.raises(ConfigError, match="needs the paged layout"):
        CacheConfig(kv_offload="host:1GiB", kv_layout="contiguous")


# ---------------------------------------------------------------------- host
def test_host_tier_prefix_walk_and_lru_budget() -> None:
    tier = HostTier(LAYOUT, capacity_bytes=3 * 256)
    for i in range(3):
        tier.store(h(i), payload(i))
    assert tier.lookup_load([h(0), h(1), h(2), h(3)]) == [payload(0), payload(1), payload(2)]
    assert tier.lookup_load([h(1), h(9), h(2)]) == [payload(1)]  # stops at the first miss
    tier.lookup_load([h(0)])  # 0 most recently used, then 1; 2 is the LRU victim
    tier.store(h(3), payload(3))
    assert not tier.contains(h(2)) and tier.contains(h(3)) and tier.contains(h(0))
    assert tier.stats.evictions == 1 and tier.stats.num_blocks == 3
    assert tier.stats.used_bytes == 3 * 256
    tier.store(h(4), b"x" * 1024)  # larger than the whole budget: dropped, nothing evicted
    assert tier.stats.dropped_stores == 1 and tier.stats.num_blocks == 3
    tier.check_integrity()


# ---------------------------------------------------------------------- disk
def test_disk_tier_round_trip_and_warm_restart(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    for i in range(4):
        tier.store(h(i), payload(i))
    tier.check_integrity()
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) == 4 and all(f.stat().st_size == HEADER_SIZE + 256 for f in files)
    again = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)  # a restarted server
    assert again.stats.num_blocks == 4
    assert again.lookup_load([h(i) for i in range(5)]) == [payload(i) for i in range(4)]
    assert again.stats.hits == 4 and again.stats.misses == 1
    assert sum(again.stats.load_latency_counts) == 1
    # Another dtype or model: another directory, and nothing of ours loads.
    other = DiskTier(OTHER_DTYPE, tmp_path, capacity_bytes=1 << 20)
    assert other.stats.num_blocks == 0 and other.lookup_load([h(0)]) == []
    again.check_integrity()


def test_disk_tier_foreign_file_is_rejected(tmp_path: Path) -> None:
    a = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    b = DiskTier(OTHER_MODEL, tmp_path, capacity_bytes=1 << 20)
    a.store(h(1), payload(1))
    # Someone copies model A's file into model B's directory under the same name.
    src = next(a.root.rglob("*.kvb"))
    dst = b.root / src.parent.name / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    assert b.lookup_load([h(1)]) == []
    assert b.stats.corrupt == 1 and not dst.exists()


def test_disk_tier_detects_corrupt_and_truncated_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    for i in range(4):
        tier.store(h(i), payload(i))
    f1 = tier.root / h(1).hex()[:2] / f"{h(1).hex()}.kvb"
    data = bytearray(f1.read_bytes())
    data[-5] ^= 0xFF
    f1.write_bytes(bytes(data))
    f3 = tier.root / h(3).hex()[:2] / f"{h(3).hex()}.kvb"
    f3.write_bytes(f3.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="kvstack.kv.tiers"):
        assert tier.lookup_load([h(0), h(1), h(2)]) == [payload(0)]
        assert tier.lookup_load([h(2), h(3)]) == [payload(2)]
    assert tier.stats.corrupt == 2 and not f1.exists() and not f3.exists()
    assert sum("corrupt" in r.getMessage() for r in caplog.records) == 1  # warned once
    tier.check_integrity()
    assert tier.stats.num_blocks == 2


def test_disk_tier_budget_evicts_files_lru(tmp_path: Path) -> None:
    size = HEADER_SIZE + 256
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=3 * size)
    for i in range(3):
        tier.store(h(i), payload(i))
    tier.lookup_load([h(0)])
    tier.store(h(3), payload(3))  # evicts 1 (0 was just used)
    names = {p.name for p in tmp_path.rglob("*.kvb")}
    assert names == {f"{h(i).hex()}.kvb" for i in (0, 2, 3)}
    assert tier.stats.evictions == 1 and tier.stats.used_bytes == 3 * size
    tier.check_integrity()
    # A restart with a smaller budget keeps only the most recent files that fit.
    smaller = DiskTier(LAYOUT, tmp_path, capacity_bytes=2 * size)
    assert smaller.stats.num_blocks == 2 and len(list(tmp_path.rglob("*.kvb"))) == 2
    smaller.check_integrity()


def test_full_disk_disables_writes_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    tier.store(h(0), payload(0))

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with caplog.at_level(logging.WARNING, logger="kvstack.kv.tiers"):
        for i in range(1, 4):
            tier.store(h(i), payload(i))
    assert tier.writes_disabled and tier.stats.errors == 1 and tier.stats.dropped_stores == 3
    assert sum("writes disabled" in r.getMessage() for r in caplog.records) == 1
    assert not list(tmp_path.rglob("*.tmp-*"))  # the failed write left nothing behind
    assert tier.lookup_load([h(0), h(1)]) == [payload(0)]  # reads go on
    tier.check_integrity()


# ---------------------------------------------------------------------- redis
@pytest.fixture(scope="module")
def redis_server() -> object:
    with LocalRedis() as server:
        yield server


def test_redis_tier_shared_between_replicas(redis_server: LocalRedis) -> None:
    a = RedisTier(LAYOUT, redis_server.url)
    b = RedisTier(LAYOUT, redis_server.url)  # a second replica
    for i in range(40):  # more than one MGET chunk
        a.store(h(100 + i), payload(i))
    got = b.lookup_load([h(100 + i) for i in range(41)])
    assert got == [payload(i) for i in range(40)]
    assert b.stats.hits == 40 and b.stats.misses == 1 and a.stats.stores == 40
    assert RedisTier(OTHER_DTYPE, redis_server.url).lookup_load([h(100)]) == []
    ttl = a.client.ttl(a._key(h(100)))
    assert isinstance(ttl, int) and 0 < ttl <= 86400
    # A corrupt value is a miss, deleted, counted.
    a.client.set(a._key(h(200)), b"garbage")
    assert b.lookup_load([h(200)]) == [] and b.stats.corrupt == 1
    assert a.client.get(a._key(h(200))) is None
    for t in (a, b):
        t.check_integrity()
        t.close()


def test_redis_down_slow_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    with LocalRedis() as server:
        tier = RedisTier(LAYOUT, server.url, timeout_s=0.2, backoff_s=0.3)
        tier.store(h(1), payload(1))
        assert tier.lookup_load([h(1)]) == [payload(1)]
        with caplog.at_level(logging.WARNING, logger="kvstack.kv.tiers"):
            # Slow: a paused server accepts nothing; every call times out.
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                assert tier.lookup_load([h(1)]) == []
                assert time.monotonic() - t0 < 1.0  # bounded by the timeout, no retries
                tier.store(h(2), payload(2))  # inside the backoff window: dropped at once
                assert tier.stats.dropped_stores == 1
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            time.sleep(0.35)
            assert tier.lookup_load([h(1)]) == [payload(1)]  # recovered
            # Down: killed; then restarted empty on the same port.
            server.kill()
            time.sleep(0.35)
            assert tier.lookup_load([h(1)]) == []
            errors = tier.stats.errors
            assert errors >= 2
            server.start()
            time.sleep(0.35)
            assert tier.lookup_load([h(1)]) == []  # the new server is empty: a plain miss
            tier.store(h(1), payload(1))
            assert tier.lookup_load([h(1)]) == [payload(1)]
        downs = [r for r in caplog.records if "unavailable" in r.getMessage()]
        ups = [r for r in caplog.records if "reachable again" in r.getMessage()]
        assert len(downs) == 2 and len(ups) == 2  # once per outage, not once per call
        tier.close()


# ---------------------------------------------------------------------- I/O thread
def test_offload_manager_loads_waterfall_promotes_and_bounds_stores(tmp_path: Path) -> None:
    host = HostTier(LAYOUT, capacity_bytes=1 << 20)
    disk = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    mgr = OffloadManager([host, disk], LAYOUT, max_pending_store_bytes=4 * 256)
    data = (torch.arange(4 * 256) % 251).to(torch.uint8).view(4, 256)
    assert mgr.submit_store([h(i) for i in range(4)], data)
    assert mgr.flush(10)
    assert host.stats.stores == 4 and disk.stats.stores == 4
    host.data.clear()  # the host lost blocks 0..3; fake a shorter host run for 0..1
    host.budget = type(host.budget)(1 << 20)
    for i in range(2):
        host.store(h(i), data[i].numpy().tobytes())
    mgr.submit_load("r1", 5, [h(i) for i in range(6)])
    assert mgr.flush(10) and not mgr.is_loading("r1")
    staged = mgr.take("r1")
    assert staged is not None and staged.start == 5 and len(staged.blocks) == 4
    assert staged.tiers == ["host", "host", "disk", "disk"]
    assert torch.equal(torch.stack(staged.blocks), data)
    assert host.contains(h(3))  # promoted from disk into host
    assert mgr.take("r1") is None
    # A cancelled load is never staged.
    mgr.submit_load("r2", 0, [h(0)])
    mgr.cancel("r2")
    mgr.flush(10)
    assert mgr.take("r2") is None
    # Past the byte bound a store is dropped and counted, never blocking.
    big = torch.zeros(8, 256, dtype=torch.uint8)
    assert not mgr.submit_store([h(50 + i) for i in range(8)], big)
    assert host.stats.dropped_stores == 8
    mgr.check_integrity()
    mgr.close()
    assert host.closed and disk.closed


def test_tier_stores_and_evictions_are_kv_events(tmp_path: Path) -> None:
    """What the I/O thread puts into a tier, and what a tier's budget evicts, is published
    with the tier as ``medium`` (the router's index counts a host/disk hit as held)."""
    from kvstack.kv.events import BlockRemoved, BlockStored, KVEventLog

    events = KVEventLog()
    host = HostTier(LAYOUT, capacity_bytes=3 * 256)
    disk = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    mgr = OffloadManager([host, disk], LAYOUT, events=events)
    data = (torch.arange(4 * 256) % 251).to(torch.uint8).view(4, 256)
    assert mgr.submit_store([h(i) for i in range(4)], data)
    assert mgr.flush(10)
    got = events.drain().events
    stored = {e.medium: e.block_hashes for e in got if isinstance(e, BlockStored)}
    assert stored == {"host": [h(i) for i in range(4)], "disk": [h(i) for i in range(4)]}
    assert all(e.token_ids == [] for e in got if isinstance(e, BlockStored))
    removed = [e for e in got if isinstance(e, BlockRemoved)]
    assert [(e.medium, e.block_hashes) for e in removed] == [("host", [h(0)])]  # 3-block budget
    assert sorted(host.held_hashes() or []) == sorted(h(i) for i in range(1, 4))
    assert len(disk.held_hashes() or []) == 4
    mgr.close()
    mgr.check_integrity()
