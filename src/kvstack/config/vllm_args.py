"""vLLM's common ``LLM(...)`` / ``vllm serve`` engine keywords, mapped onto kvstack's options.

vLLM's ``EngineArgs`` has keywords for machinery a CPU engine in one process does not
have (GPU memory, tensor parallelism, CUDA graphs, the Hugging Face hub). A script
written for vLLM passes them anyway, so each one here is either *mapped* (it changes a
kvstack option: ``enable_prefix_caching=False`` is ``prefix_cache="none"``,
``gpu_memory_utilization=0.5`` sizes the KV pool at half the free RAM), *accepted*
because it already holds (``enforce_eager=True``: kvstack never captures graphs), or
refused with a ``ConfigError`` that names the keyword and says why. kvstack's own
option names (``EngineConfig``) are taken as they are; anything else is a ``TypeError``
from ``options.build``. The table is the documentation (``LLM``'s docstring lists it).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstack.core.errors import ConfigError, ModelLoadError

Apply = Callable[[Any, dict[str, Any]], None]


@dataclass(frozen=True)
class VllmKeyword:
    """One vLLM keyword: what it means here, and how it changes kvstack's options."""

    meaning: str
    apply: Apply | None = None  # None: accepted, nothing to change
    cli: type | None = None  # the flag's type on engine commands (None: no flag)


def _prefix_caching(value: Any, out: dict[str, Any]) -> None:
    if not value:
        out["prefix_cache"] = "none"
    elif out.get("prefix_cache") == "none":
        raise ConfigError("enable_prefix_caching=True contradicts prefix_cache='none'")


def _gpu_memory_utilization(value: Any, out: dict[str, Any]) -> None:
    if not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")
    if out.get("kv_cache_memory") is not None or out.get("num_blocks") is not None:
        raise ConfigError(
            "gpu_memory_utilization sizes the KV pool: give it or kv_cache_memory / "
            "num_blocks, not both"
        )
    out["kv_cache_memory"] = kv_share(value, weights_bytes(out.get("model", "default")))


def kv_share(fraction: float, weights: int) -> int:
    """KV pool bytes for ``--gpu-memory-utilization fraction``, as vLLM's CPU backend
    reads it: the fraction of *total* RAM this server may use, weights, runtime and KV
    together, so KV = fraction x MemTotal - this process's RSS - the weights about to
    load. It is then capped so the pool never takes more than 80 % of the RAM available
    after the weights (a shared host keeps room); ``ConfigError`` if nothing is left."""
    total, avail = meminfo("MemTotal"), meminfo("MemAvailable")
    wanted = int(fraction * total) - process_rss() - weights
    cap = int(0.8 * (avail - weights))
    kv = min(wanted, cap)
    if kv <= 0:
        raise ConfigError(
            f"gpu_memory_utilization={fraction}: {fraction:.0%} of {total / 2**30:.1f} GiB "
            f"leaves no room for the KV cache after the weights ({weights / 2**30:.2f} GiB) "
            "and this process; raise it or give kv_cache_memory (--kv-cache-memory-bytes)"
        )
    return kv


def weights_bytes(model: str) -> int:
    """Bytes of the model's weight files (a .gguf, or a folder's *.safetensors); 0 when
    the model cannot be found yet (the load reports that)."""
    from kvstack.model.loader.registry import resolve_model_path

    try:
        path = resolve_model_path(model)
    except ModelLoadError:  # an unknown model fails at load, with its own message
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def meminfo(field_name: str) -> int:
    """Bytes of ``/proc/meminfo``'s ``field_name`` (``MemTotal``, ``MemAvailable``)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            lines = f.readlines()
    except OSError:  # no /proc (not Linux): physical / free pages instead
        lines = []
    for line in lines:
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    pages = "SC_PHYS_PAGES" if field_name == "MemTotal" else "SC_AVPHYS_PAGES"
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages))


def available_memory() -> int:
    """Bytes of RAM the kernel says are available now (``MemAvailable``)."""
    return meminfo("MemAvailable")


def process_rss() -> int:
    """This process's resident bytes now (``/proc/self/statm``; 0 where there is none)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _must_be(name: str, ok: Callable[[Any], bool], why: str) -> Apply:
    def apply(value: Any, out: dict[str, Any]) -> None:
        if not ok(value):
            raise ConfigError(f"{name}={value!r}: {why}")

    return apply


def _one(name: str) -> Apply:
    return _must_be(name, lambda v: v in (1, None), "kvstack runs one engine process on CPU")


def _unset(name: str, why: str) -> Apply:
    return _must_be(name, lambda v: v in (None, 0, False, ""), why)


NO_HUB = "kvstack loads local files only (a .gguf or a Hugging Face folder); no hub download"
VLLM_KEYWORDS: dict[str, VllmKeyword] = {
    "enable_prefix_caching": VllmKeyword(
        "False: prefix_cache='none'; True: keep prefix_cache (default 'hash', vLLM's APC)",
        _prefix_caching,
    ),
    "gpu_memory_utilization": VllmKeyword(
        "fraction of total RAM for weights, runtime and KV together, as vLLM's CPU "
        "backend reads it (KV = fraction x RAM - RSS - weights), capped at 80 % of the "
        "RAM available after the weights; sets kv_cache_memory",
        _gpu_memory_utilization,
        cli=float,
    ),
    "tensor_parallel_size": VllmKeyword("must be 1", _one("tensor_parallel_size"), cli=int),
    "pipeline_parallel_size": VllmKeyword("must be 1", _one("pipeline_parallel_size"), cli=int),
    "data_parallel_size": VllmKeyword(
        "must be 1 (replicas: kvstack router or kvstack serve --ray)",
        _one("data_parallel_size"),
        cli=int,
    ),
    "enforce_eager": VllmKeyword(
        "accepted: kvstack always runs eagerly (no CUDA graphs)", cli=bool
    ),
    "max_seq_len_to_capture": VllmKeyword("accepted: no CUDA graphs to capture", cli=int),
    "compilation_config": VllmKeyword("accepted: no torch.compile / CUDA graph capture", cli=str),
    "trust_remote_code": VllmKeyword(
        "accepted: kvstack never runs code from a checkpoint", cli=bool
    ),
    "disable_log_stats": VllmKeyword("accepted: the offline LLM logs no stats", cli=bool),
    "disable_custom_all_reduce": VllmKeyword("accepted: one process, no all-reduce", cli=bool),
    "swap_space": VllmKeyword(
        "accepted: preempted requests are recomputed, never swapped (as in vLLM v1)", cli=float
    ),
    "served_model_name": VllmKeyword("accepted: names the model on a server; offline, unused"),
    "prefix_caching_hash_algo": VllmKeyword(
        "accepted: names the hash of published KV events (kvstack serve "
        "--prefix-caching-hash-algo); the engine's own prefix hash is kvstack's"
    ),
    "tokenizer_mode": VllmKeyword(
        "must be 'auto'",
        _must_be("tokenizer_mode", lambda v: v in ("auto", None), "kvstack has one tokenizer"),
        cli=str,
    ),
    "cpu_offload_gb": VllmKeyword(
        "must be 0: weights stay in RAM (for KV, kv_offload='host:SIZE')",
        _unset("cpu_offload_gb", "weights stay in RAM; offload KV with kv_offload='host:SIZE'"),
        cli=float,
    ),
    "kv_events_config": VllmKeyword(
        "refused offline: only kvstack serve publishes KV events (--kv-events-config)",
        _unset("kv_events_config", "only kvstack serve publishes KV events"),
    ),
    **{
        name: VllmKeyword(f"must be None: {NO_HUB}", _unset(name, NO_HUB), cli=str)
        for name in ("revision", "tokenizer_revision", "download_dir", "hf_token")
    },
}


def translate(values: Mapping[str, Any]) -> dict[str, Any]:
    """kvstack options from ``values``: vLLM keywords applied, the rest passed through.

    kvstack's own options are applied first, so a mapped keyword sees them (and refuses
    a contradiction, e.g. ``gpu_memory_utilization`` with ``kv_cache_memory``).
    """
    out = {k: v for k, v in values.items() if k not in VLLM_KEYWORDS}
    for name, value in values.items():
        kw = VLLM_KEYWORDS.get(name)
        if kw is not None and kw.apply is not None:
            kw.apply(value, out)
    return out


def add_cli_flags(group: argparse._ArgumentGroup) -> None:
    """vLLM's engine flags (``--gpu-memory-utilization``, ``--enforce-eager``...), dest
    ``vllm_<name>``, default None: ``cli_values`` returns the ones given."""
    for name, kw in VLLM_KEYWORDS.items():
        if kw.cli is None:
            continue
        flag = "--" + name.replace("_", "-")
        text = f"vLLM's flag: {kw.meaning}".replace("%", "%%")
        if kw.cli is bool:
            group.add_argument(flag, dest="vllm_" + name, action="store_true", default=None,
                               help=text)  # fmt: skip
        else:
            group.add_argument(flag, dest="vllm_" + name, type=kw.cli, default=None,
                               metavar=name.split("_")[-1].upper(), help=text)  # fmt: skip


def cli_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The vLLM keywords ``add_cli_flags``' flags were given on the command line."""
    out = {}
    for name in VLLM_KEYWORDS:
        value = getattr(ns, "vllm_" + name, None)
        if value is not None:
            out[name] = value
    return out


def describe(indent: str = "    ") -> str:
    """One reST line per vLLM keyword (for ``LLM``'s docstring)."""
    return "\n".join(f"{indent}``{n}``: {k.meaning}" for n, k in VLLM_KEYWORDS.items())
