"""``kvstack doctor``: what to paste into a bug report about this machine and install.

The CPU (model, the ISA flags the kernels care about, the kernel levels it can run), the
C++ kernels (levels built, where, whether current with the sources, the level loaded or
why none: ``model/kernels/isa.py``, ``model/kernels/loader.py``), torch and oneDNN
versions and threads, the dtype ``--dtype auto`` gives and why (``isa.auto_dtype``, the
function the engine's config resolves it with), whether oneDNN runs bf16 natively, free
memory and the KV pool ``--kv-cache-memory`` would size for ``--model`` in that dtype.
Environment variables that steer kvstack or its thread pools are listed with any value
whose name looks like a secret (token, key, password, ...) redacted. Read-only: it loads
the kernels, never builds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from typing import Any

ENV_PREFIXES = ("KVSTACK_", "OMP_", "MKL_", "KMP_", "HF_", "VLLM_", "CXX")
SECRET = re.compile(r"TOKEN|KEY|SECRET|PASS|AUTH|CREDENTIAL|COOKIE", re.IGNORECASE)
GIB = 1024**3


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="the machine, kernel build and defaults, for a bug report",
        description="Print the CPU model and ISA flags, the C++ kernel level loaded (or why "
        "none), torch and oneDNN versions, the dtype --dtype auto picks, free memory and "
        "the KV pool --kv-cache-memory would size: what a bug report needs (secrets "
        "redacted). Builds nothing.",
    )
    p.add_argument("--model", default="default", help="model whose KV pool to size (default)")
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV pool size to check, e.g. 2GiB (default: the engine's default)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.set_defaults(func=run)


def redact_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables named by ``ENV_PREFIXES``, secret-looking values replaced."""
    return {
        k: ("<redacted>" if SECRET.search(k) else v)
        for k, v in sorted(environ.items())
        if k.startswith(ENV_PREFIXES)
    }


def onednn_version() -> str:
    import torch

    m = re.search(r"MKL-DNN (v[\d.]+)", torch.__config__.show())
    return m.group(1) if m else "not built in"


def cpu_section() -> dict[str, Any]:
    from kvstack.model.kernels import isa

    model, flags = isa.cpu()
    wanted = set().union(*(lv.cpu_flags for lv in isa.LEVELS))
    shown = sorted(f for f in flags if f in wanted or f.startswith(("avx512", "amx")))
    return {
        "cpu": model or "unknown",
        "cpu_count": os.cpu_count(),
        "cpu_isa_flags": " ".join(shown) or "(none)",
        "cpu_levels": ", ".join(lv.name for lv in isa.runnable(flags)) or "none (no AVX2 + FMA)",
    }


def kernel_section() -> dict[str, Any]:
    import torch

    from kvstack.model.kernels import isa
    from kvstack.model.kernels import loader as kernels
    from kvstack.model.kernels.files import kernel_dir, read_manifest, sources_hash, stale_reason

    directory = kernel_dir()
    manifest = read_manifest(directory)
    if manifest is None:
        built = f"none in {directory}"
    else:
        stale = stale_reason(manifest, sources_hash(), torch.__version__)
        built = f"{', '.join(manifest.levels)} in {directory} ({stale or 'current'})"
    kernels.load_kernels()
    return {
        "kernels_built": built,
        "kernels_loaded": kernels.kernel_state(),
        "kernels_disabled": kernels.kernels_disabled(),
        "onednn_native_bf16": isa.onednn_bf16(),
    }


def memory_section(model: str, kv_memory: str | None) -> dict[str, Any]:
    import torch

    from kvstack.config.engine import DEFAULT_KV_CACHE_MEMORY
    from kvstack.config.vllm_args import available_memory
    from kvstack.core.errors import KvstackError
    from kvstack.core.units import parse_size
    from kvstack.kv.storage import KVStorage
    from kvstack.model.kernels.isa import auto_dtype
    from kvstack.model.loader.registry import read_model_config

    choice = auto_dtype()  # what --dtype auto resolves to in EngineConfig
    dtype = choice.dtype
    memory = parse_size(kv_memory) if kv_memory else DEFAULT_KV_CACHE_MEMORY
    free = available_memory()
    out: dict[str, Any] = {
        "dtype_auto": f"{dtype} ({choice.reason()})",
        "memory_available": f"{free / GIB:.1f} GiB",
        "kv_cache_memory": f"{memory / GIB:.2f} GiB"
        + (" (more than is available)" if memory > free else ""),
    }
    try:
        cfg = read_model_config(model)
    except KvstackError as e:
        out["kv_pool"] = f"unknown ({e})"
        return out
    blocks = KVStorage.num_blocks_for_memory(cfg, 16, getattr(torch, dtype), memory)
    out["kv_pool"] = f"{blocks} blocks of 16 tokens = {blocks * 16} tokens ({model}, {dtype})"
    return out


def collect(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import kvstack

    report: dict[str, Any] = {
        "kvstack": kvstack.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
    }
    report |= cpu_section()
    report |= {
        "torch": torch.__version__,
        "onednn": onednn_version(),
        "torch_threads": torch.get_num_threads(),
    }
    report |= kernel_section()
    report |= memory_section(args.model, args.kv_cache_memory)
    report["env"] = redact_env(dict(os.environ))
    return report


def run(args: argparse.Namespace) -> int:
    report = collect(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    width = max(len(k) for k in report)
    for key, value in report.items():
        if key == "env":
            shown = " ".join(f"{k}={v}" for k, v in value.items()) or "(none set)"
            print(f"{key:<{width}}  {shown}")
        else:
            print(f"{key:<{width}}  {value}")
    return 0
