"""``Registry[T]`` and the registries built on it: names, order, errors, CLI choices."""

from __future__ import annotations

import pytest

from kvstack.core.errors import ConfigError
from kvstack.core.registry import Registry


def test_registry_keeps_order_and_rejects_duplicates() -> None:
    reg: Registry[int] = Registry("widget")
    reg.add("b", 2, "the second")
    reg.register("a")(1)
    assert reg.names() == ("b", "a") and list(reg) == ["b", "a"] and len(reg) == 2
    assert reg.get("a") == 1 and reg["b"] == 2 and "a" in reg and "c" not in reg
    assert reg.describe() == "b = the second; a"
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.add("a", 3)
    with pytest.raises(ConfigError, match=r"unknown widget 'c'; choose one of: b, a"):
        reg.get("c")
    with pytest.raises(ConfigError, match="unknown widget"):
        reg.check(None)  # type: ignore[arg-type]


def test_every_extension_point_has_one_registry() -> None:
    """The CLI choices come from the registries (no second hand-typed list)."""
    from kvstack.cli import build_parser
    from kvstack.config.choices import VLLM_KV_CACHE_DTYPES
    from kvstack.kv.codecs import CODECS
    from kvstack.kv.layouts import KV_LAYOUTS
    from kvstack.kv.manager import PREFIX_CACHES
    from kvstack.kv.policies import EVICTION_POLICIES
    from kvstack.kv.press import PRESSES
    from kvstack.kv.tiers.spec import TIERS
    from kvstack.model.quant.schemes import QUANTIZATIONS
    from kvstack.route.policy import ROUTING_POLICIES
    from kvstack.serve.chat.reasoning_parsers import REASONING_PARSERS

    regs = {
        "--prefix-cache": PREFIX_CACHES,
        "--eviction-policy": EVICTION_POLICIES,
        "--kv-layout": KV_LAYOUTS,
        "--kv-cache-dtype": CODECS,
        "--kv-press": PRESSES,
        "--quantization": QUANTIZATIONS,
        "--reasoning-parser": REASONING_PARSERS,
    }
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {opt: a for a in serve._actions for opt in a.option_strings}
    aliases = {"--kv-cache-dtype": tuple(VLLM_KV_CACHE_DTYPES)}  # vLLM's spellings, mapped
    for flag, reg in regs.items():
        assert tuple(flags[flag].choices) == reg.names() + aliases.get(flag, ()), flag
    assert tuple(flags["--policy"].choices) == ROUTING_POLICIES.names()
    assert TIERS.names() == ("host", "disk", "redis")
    from kvstack.route.router.event_sources import EVENT_SOURCES

    assert EVENT_SOURCES.names() == ("sse", "zmq")  # --kv-events-endpoint picks zmq
    assert all(isinstance(r, Registry) for r in [*regs.values(), ROUTING_POLICIES, TIERS])
