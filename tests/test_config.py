from __future__ import annotations

import pytest

from kvstack.config import CacheConfig, parse_size
from kvstack.errors import ConfigError


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")
    with pytest.raises(ConfigError):
        parse_size("0")


def test_cache_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError):
        CacheConfig(block_size=0)
    with pytest.raises(ConfigError):
        CacheConfig(num_blocks=-1)
