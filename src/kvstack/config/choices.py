"""Choices of ``config/engine.py``'s options: the extension points' registries, read lazily,
and vLLM's spellings of kvstack's values (accepted as choices, converted)."""

from __future__ import annotations

from collections.abc import Iterable


# Choices are the extension points' registries, imported when first read: ``kvstack
# --help`` builds every parser, and the codec and press modules import torch.
def prefix_caches() -> Iterable[str]:
    from kvstack.kv.manager import PREFIX_CACHES

    return PREFIX_CACHES.names()


def eviction_policies() -> Iterable[str]:
    from kvstack.kv.policies import EVICTION_POLICIES

    return EVICTION_POLICIES.names()


def kv_layouts() -> Iterable[str]:
    from kvstack.kv.layouts import KV_LAYOUTS

    return KV_LAYOUTS.names()


def codecs() -> Iterable[str]:
    from kvstack.kv.codecs import CODECS

    return CODECS.names()


# vLLM's spellings of kvstack's values (``--kv-cache-dtype fp8_e4m3``): accepted as
# choices and converted to kvstack's name (idempotent, as ``convert`` must be).
# float16 / half: kvstack's CPU kernels compute in bfloat16, the other 16-bit format (same
# memory, wider exponent range), so a vLLM command line asking for fp16 gets bfloat16.
VLLM_DTYPES = {
    "bf16": "bfloat16", "float": "float32", "fp32": "float32",
    "half": "bfloat16", "float16": "bfloat16", "fp16": "bfloat16",
}  # fmt: skip
VLLM_KV_CACHE_DTYPES = {"fp8_e4m3": "fp8", "bfloat16": "bf16"}
DTYPES = ("auto", "bfloat16", "float32", *VLLM_DTYPES)


def to_dtype(value: str) -> str:
    """kvstack's dtype for ``value``: ``auto`` is resolved here, from this CPU's ISA
    (``model/kernels/isa.py``'s ``auto_dtype``: bfloat16 with AVX2 or better, native or
    as storage; float32 without AVX2), so every config holds a concrete dtype. Idempotent."""
    if value == "auto":
        from kvstack.model.kernels.isa import auto_dtype

        return auto_dtype().dtype
    return VLLM_DTYPES.get(value, value)


def to_kv_cache_dtype(value: str) -> str:
    return VLLM_KV_CACHE_DTYPES.get(value, value)


def codecs_and_aliases() -> Iterable[str]:
    return (*codecs(), *VLLM_KV_CACHE_DTYPES)


def quantizations() -> Iterable[str]:
    from kvstack.model.quant.schemes import QUANTIZATIONS

    return QUANTIZATIONS.names()


def presses() -> Iterable[str]:
    from kvstack.kv.press import PRESSES

    return PRESSES.names()
