"""Issue 20's tier findings: the disk tier followed planted symlinks, deleted other
processes' temp files and left modes to the umask (finding 6); the Redis tier printed its
password and parsed only ``redis://`` (finding 7)."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest
import redis

from kvstack.errors import ConfigError
from kvstack.kv.tiers.block_format import BlockLayout
from kvstack.kv.tiers.disk import STALE_TMP_S, DiskTier
from kvstack.kv.tiers.redis_tier import RedisTier
from kvstack.kv.tiers.redis_url import redacted
from kvstack.kv.tiers.spec import parse_offload_spec

LAYOUT = BlockLayout("model-a", "bfloat16", 4, 2, 1, 8, 2)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(LAYOUT.payload_bytes))


def block_path(tier: DiskTier, i: int) -> Path:
    return tier.root / h(i).hex()[:2] / f"{h(i).hex()}.kvb"


# ----------------------------------------------------------------- finding 6
def test_store_never_writes_through_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    tier = DiskTier(LAYOUT, tmp_path / "cache", capacity_bytes=1 << 20)
    target = block_path(tier, 1)
    target.parent.mkdir(parents=True)
    # Every temp name the old code could pick (pid-based) and the final name: symlinks.
    os.symlink(victim, target.with_name(f"{target.name}.tmp-{os.getpid()}"))
    os.symlink(victim, target)
    tier.store(h(1), payload(1))
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and tier.lookup_load([h(1)]) == [payload(1)]
    tier.check_integrity()


def test_a_symlinked_subdirectory_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tier = DiskTier(LAYOUT, tmp_path / "cache", capacity_bytes=1 << 20)
    os.symlink(elsewhere, tier.root / h(2).hex()[:2])
    tier.store(h(2), payload(2))
    assert list(elsewhere.iterdir()) == [] and tier.stats.errors == 1
    assert tier.lookup_load([h(2)]) == []
    tier.check_integrity()


def test_reads_never_follow_a_symlinked_block(tmp_path: Path) -> None:
    a = DiskTier(LAYOUT, tmp_path / "a", capacity_bytes=1 << 20)
    a.store(h(3), payload(3))
    b = DiskTier(LAYOUT, tmp_path / "b", capacity_bytes=1 << 20)
    link = block_path(b, 3)
    link.parent.mkdir(parents=True)
    os.symlink(block_path(a, 3), link)  # a valid block, reached through a link
    assert b.lookup_load([h(3)]) == [] and b.stats.errors == 1
    b.check_integrity()


def test_scan_keeps_a_live_peers_temp_file_and_modes_are_private(tmp_path: Path) -> None:
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)
    tier.store(h(4), payload(4))
    sub = block_path(tier, 4).parent
    young = sub / "ab.kvb.tmp-99999-0011"  # another process is writing it right now
    old = sub / "cd.kvb.tmp-99998-0022"  # a crashed write
    young.write_bytes(b"x")
    old.write_bytes(b"x")
    stale = time.time() - STALE_TMP_S - 60
    os.utime(old, (stale, stale))
    DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20)  # a second process starts
    assert young.exists() and not old.exists()
    for d in (tier.root, sub):
        assert stat.S_IMODE(d.stat().st_mode) & 0o077 == 0, oct(d.stat().st_mode)
    assert stat.S_IMODE(block_path(tier, 4).stat().st_mode) & 0o077 == 0


# ----------------------------------------------------------------- finding 7
def test_redis_password_never_reaches_logs(caplog: pytest.LogCaptureFixture) -> None:
    url = "redis://:hunter2@127.0.0.1:1/0?timeout=0.05"
    tier = RedisTier(LAYOUT, url, timeout_s=0.05)
    assert "hunter2" not in tier.describe() and "***" in tier.describe()
    with caplog.at_level(logging.WARNING, logger="kvstack.kv.tiers"):
        assert tier.lookup_load([h(1)]) == []  # nothing listens on port 1
    assert tier.stats.errors == 1
    assert caplog.records and not any("hunter2" in r.getMessage() for r in caplog.records)
    tier.close()
    with pytest.raises(ConfigError) as e:
        parse_offload_spec("redis://:hunter2@127.0.0.1:6379?ttl=-1")
    assert "hunter2" not in str(e.value)
    assert redacted("redis://app:s3cret@h:6379/2") == "redis://app:***@h:6379/2"


def test_redis_urls_are_read_by_redis_py() -> None:
    """ACL user, TLS and unix sockets (only redis://host:port/db parsed before)."""
    acl = RedisTier(LAYOUT, "redis://app:s3cret@127.0.0.1:6390/3")
    kw = acl.client.connection_pool.connection_kwargs
    assert (kw["username"], kw["password"], kw["db"], kw["port"]) == ("app", "s3cret", 3, 6390)
    tls = RedisTier(LAYOUT, parse_offload_spec("rediss://127.0.0.1:6390?ttl=60")[0].url)
    assert tls.client.connection_pool.connection_class is redis.SSLConnection
    sock = RedisTier(LAYOUT, "unix:///tmp/kvstack-test.sock?db=2&timeout=0.1")
    pool = sock.client.connection_pool
    assert pool.connection_class is redis.UnixDomainSocketConnection
    assert pool.connection_kwargs["path"] == "/tmp/kvstack-test.sock"
    assert pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["socket_timeout"] == 0.25  # ours, not the URL's option
    for tier in (acl, tls, sock):
        tier.close()
