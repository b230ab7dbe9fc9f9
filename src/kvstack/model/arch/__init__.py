"""``ARCHITECTURES``: the model families kvstack serves, and how a checkpoint finds its own.

One ``Architecture`` per family (``base.py``), one module each: ``llama``, ``qwen2``,
``qwen3``, ``mistral``, ``gemma3``. A Hugging Face folder is matched by its ``config.json``
``architectures`` classes first, then its ``model_type``; a GGUF by
``general.architecture``. Anything else is a ``ModelLoadError`` listing the families.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstack.core.errors import ModelLoadError
from kvstack.core.registry import Registry
from kvstack.model.arch.base import Architecture, Features, check_window
from kvstack.model.arch.gemma3 import GEMMA3
from kvstack.model.arch.llama import LLAMA
from kvstack.model.arch.mistral import MISTRAL
from kvstack.model.arch.qwen2 import QWEN2
from kvstack.model.arch.qwen3 import QWEN3

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Features",
    "arch_for_gguf",
    "arch_for_hf",
    "check_window",
]

ARCHITECTURES: Registry[Architecture] = Registry("model architecture")
for _arch in (LLAMA, QWEN2, QWEN3, MISTRAL, GEMMA3):
    ARCHITECTURES.add(_arch.name, _arch, help=_arch.summary)


def _families() -> str:
    return "; ".join(a.describe() for _, a in ARCHITECTURES.items())


def arch_for_hf(cfg: Mapping[str, Any], where: Path) -> Architecture:
    """The family of a ``config.json``: by ``architectures``, else by ``model_type``."""
    classes = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    archs = [a for _, a in ARCHITECTURES.items()]
    for cls in classes if isinstance(classes, list) else []:
        for arch in archs:
            if cls in arch.hf_classes:
                return arch
    for arch in archs:
        if model_type in arch.model_types:
            return arch
    raise ModelLoadError(
        f"{where}: unsupported architecture {classes or model_type!r}; kvstack serves {_families()}"
    )


def arch_for_gguf(name: object, where: Path) -> Architecture:
    """The family of a GGUF's ``general.architecture``."""
    for _, arch in ARCHITECTURES.items():
        if name in arch.gguf_names:
            return arch
    names = ", ".join(n for _, a in ARCHITECTURES.items() for n in a.gguf_names)
    raise ModelLoadError(
        f"{where}: unsupported architecture {name!r}; kvstack reads GGUFs of {names}"
    )
