from __future__ import annotations

import pytest

from kvstack.config.engine import CacheConfig, EngineConfig, parse_size
from kvstack.core.errors import ConfigError
from kvstack.core.options import option_specs


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


def test_old_import_paths_still_work() -> None:
    from kvstack.config import engine as config
    from kvstack.core import model_config, units

    assert config.ModelConfig is model_config.ModelConfig
    assert config.RopeScaling is model_config.RopeScaling
    assert config.parse_size is units.parse_size


def test_options_are_flat_unique_and_round_trip() -> None:
    names = [s.name for s in option_specs(EngineConfig)]
    assert len(names) == len(set(names))
    assert {"model", "block_size", "kv_press", "max_num_seqs", "enable_chunked_prefill"} <= set(
        names
    )
    c = EngineConfig.from_options(
        model="m.gguf", block_size=32, kv_cache_memory="1GiB", enable_chunked_prefill=False
    )
    assert c.cache.block_size == 32 and c.cache.kv_cache_memory == 1 << 30
    assert c.scheduler.enable_chunked_prefill is False
    assert EngineConfig.from_options(**c.options()) == c
    assert c.replace(seed=3).seed == 3 and c.replace(seed=3).cache == c.cache
    with pytest.raises(ConfigError, match="power of two"):
        c.replace(block_size=24)


def test_unknown_option_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"'block_sise'.*block_size"):
        EngineConfig.from_options(block_sise=8)


def test_choices_are_checked_with_the_old_messages() -> None:
    with pytest.raises(ConfigError, match="unknown prefix_cache 'trie'; choose one of: hash"):
        CacheConfig(prefix_cache="trie")
    with pytest.raises(ConfigError, match="unknown eviction_policy 'mru'"):
        CacheConfig(eviction_policy="mru")
    with pytest.raises(ConfigError, match="unknown kv_layout 'flat'"):
        CacheConfig(kv_layout="flat")
    with pytest.raises(ConfigError, match="dtype must be 'float32' or 'bfloat16'"):
        EngineConfig(dtype="float16")


def test_llm_rejects_an_unknown_keyword_before_loading_anything() -> None:
    from kvstack.engine.llm import LLM

    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'num_block'"):
        LLM("/nonexistent/model.gguf", num_block=8)
    with pytest.raises(ConfigError, match="memory size"):  # validated before the model loads
        LLM("/nonexistent/model.gguf", kv_cache_memory="lots")


def test_llm_docstring_lists_every_option() -> None:
    from kvstack.engine.llm import LLM

    doc = LLM.__doc__ or ""
    for s in option_specs(EngineConfig):
        assert f"``{s.name}``" in doc, s.name
