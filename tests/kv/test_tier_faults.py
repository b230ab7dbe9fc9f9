"""The tiers' faults: the disk tier followed planted symlinks, deleted other processes'
temp files and left modes to the umask; the Redis tier printed its password and parsed
only ``redis://``."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import time
import zlib
from pathlib import Path

import pytest
import redis

from kvstack.config.engine import CacheConfig
from kvstack.core.errors import ConfigError
from kvstack.kv.tiers.block_format import (
    HEADER_SIZE,
    TAG_SIZE,
    BlockLayout,
    CorruptBlockError,
    decode,
    encode,
)
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


# ----------------------------------------------------------------- disk tier
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


# ----------------------------------------------------------------- Redis tier: the password
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


# ----------------------------------------------------------------- tiers as trusted storage
KEY = b"0123456789abcdef-tier-secret"


def test_hmac_signed_blocks_refuse_a_forgery(tmp_path: Path) -> None:
    """A CRC is not a MAC: who can write the folder could inject KV with a valid CRC."""
    signed = dataclasses.replace(LAYOUT, auth_key=KEY)
    tier = DiskTier(signed, tmp_path, capacity_bytes=1 << 20)
    tier.store(h(1), payload(1))
    assert tier.lookup_load([h(1)]) == [payload(1)]
    f = block_path(tier, 1)
    assert f.stat().st_size == HEADER_SIZE + LAYOUT.payload_bytes + TAG_SIZE
    # The attacker writes a well-formed block (right header, right CRC) without the key.
    forged = encode(LAYOUT, h(2), payload(7))
    target = block_path(tier, 2)
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(forged)
    assert tier.lookup_load([h(2)]) == [] and tier.stats.corrupt == 1
    # ... or the signed block with its payload changed and the CRC fixed up.
    data = bytearray(f.read_bytes())
    data[HEADER_SIZE] ^= 0xFF
    data[40:44] = zlib.crc32(bytes(data[HEADER_SIZE : HEADER_SIZE + LAYOUT.payload_bytes])
                             ).to_bytes(4, "little")  # fmt: skip
    f.write_bytes(bytes(data))
    assert tier.lookup_load([h(1)]) == [] and tier.stats.corrupt == 2
    other_key = dataclasses.replace(LAYOUT, auth_key=b"x" * 16)
    with pytest.raises(CorruptBlockError, match="another model"):  # its namespace differs
        decode(signed, h(3), encode(other_key, h(3), payload(3)))
    with pytest.raises(CorruptBlockError, match="signed, but this tier has no key"):
        decode(LAYOUT, h(1), encode(signed, h(1), payload(1)))
    # Another key, or none, is another namespace: never even looked up there.
    assert signed.namespace != LAYOUT.namespace
    assert signed.namespace != dataclasses.replace(LAYOUT, auth_key=b"y" * 16).namespace
    tier.check_integrity()


def test_offload_key_file_is_checked_at_startup(tmp_path: Path) -> None:
    good, short = tmp_path / "k", tmp_path / "short"
    good.write_bytes(KEY + b"\n")
    short.write_bytes(b"tiny")
    cfg = CacheConfig(kv_offload=f"disk:{tmp_path}:1MiB", kv_offload_key_file=str(good))
    assert cfg.offload_key() == KEY
    with pytest.raises(ConfigError, match="at least 16"):
        CacheConfig(kv_offload=f"disk:{tmp_path}:1MiB", kv_offload_key_file=str(short))
    with pytest.raises(ConfigError, match="needs --kv-offload"):
        CacheConfig(kv_offload_key_file=str(good))
    with pytest.raises(ConfigError, match="kv-offload-key-file"):
        CacheConfig(kv_offload=f"disk:{tmp_path}:1MiB", kv_offload_key_file=str(tmp_path / "x"))


def test_a_full_disk_is_rechecked_and_stores_resume_once_space_is_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After ENOSPC the disk tier never wrote again (``stores`` flat, ``dropped_stores``
    growing) and its index listed the files an operator deleted until a restart."""
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20, full_backoff_s=1.0)
    evicted: list[bytes] = []
    tier.watch_evictions(evicted.extend)
    for i in range(3):
        tier.store(h(i), payload(i))
    replace = os.replace
    attempts: list[str] = []

    def no_space(*args: object, **kwargs: object) -> None:
        attempts.append("write")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    tier.store(h(10), payload(10))
    tier.store(h(11), payload(11))  # inside the back-off: dropped without a write
    assert tier.writes_disabled and attempts == ["write"] and tier.stats.dropped_stores == 2
    time.sleep(1.05)
    tier.store(h(12), payload(12))  # re-checked: still full, so the back-off doubles
    assert len(attempts) == 2 and tier.writes_disabled
    # The operator frees space by deleting two of the tier's files.
    block_path(tier, 0).unlink()
    block_path(tier, 1).unlink()
    monkeypatch.setattr(os, "replace", replace)
    time.sleep(2.1)  # the doubled back-off
    stores = tier.stats.stores
    tier.store(h(13), payload(13))
    assert not tier.writes_disabled and tier.stats.stores == stores + 1
    assert not tier.contains(h(0)) and not tier.contains(h(1)) and sorted(evicted) == [h(0), h(1)]
    tier.store(h(0), payload(0))  # a block whose file was deleted is stored again
    assert tier.contains(h(0)) and tier.lookup_load([h(0)]) == [payload(0)]
    assert tier.stats.num_blocks == 3  # blocks 0, 2 and 13: the index matches the disk
    tier.check_integrity()


def test_a_full_disk_waits_for_statvfs_to_show_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(LAYOUT, tmp_path, capacity_bytes=1 << 20, full_backoff_s=0.0)
    real_replace, real_statvfs = os.replace, os.statvfs

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(os, "replace", no_space)
    tier.store(h(0), payload(0))
    monkeypatch.setattr(os, "replace", real_replace)
    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    tier.store(h(1), payload(1))  # no room reported: no write tried
    assert tier.writes_disabled and tier.stats.stores == 0
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    tier.store(h(2), payload(2))
    assert not tier.writes_disabled and tier.stats.stores == 1 and tier.contains(h(2))
