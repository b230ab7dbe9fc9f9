"""Optional C++ kernels, built ahead of time and loaded at the best ISA level this CPU runs.

``csrc/`` holds the paged decode attention (K/V read in place through block tables; for
an encoded cache ``paged_attention_codecs.cpp`` dequantizes each codec's blocks in the
kernel, reading what its ``KernelView`` names, and ``codec_write.cpp`` encodes the
per-token codecs' new rows and ``codec_gather.cpp`` decodes their blocks for long prefill
chunks, the same bits as their PyTorch ``encode`` / ``decode``), the fused per-token ops of a layer
(``fused_ops.cpp``: RMSNorm, residual add + RMSNorm, SiLU-and-mul, RoPE + KV-cache
write), the bf16 linears for decode-sized inputs (``amx_linear.cpp`` on AMX tiles,
``bf16_linear.cpp`` on AVX512-BF16, sharing ``dpbf16.h`` with the causal prefill attention
of ``prefill_attention.cpp``, or on AVX2 + FMA through ``fma_bf16.h``) and the weight-only
quantized linears (``quant_linear.cpp``; with int8 activations ``quant_vnni.cpp``, and
``quant_gemv.cpp`` over 16-row weight tiles on AVX512-VNNI). They are compiled at install
(``pip install --no-build-isolation``, ``make setup``; ``make kernels`` rebuilds after an
edit) into one library per ISA level (``model/kernels/build.py``); ``load_kernels`` opens
the one ``model/kernels/isa.py`` chooses for this CPU and never compiles. ``KVSTACK_NO_KERNELS=1``
forces the PyTorch path (tests compare both).

Fallbacks are never silent: every time the engine takes the PyTorch path where a kernel
was meant to run, ``note_fallback(kernel, reason)`` counts it (one warning per pair, the
first time) and the server exports the counts as ``kvstack:kernel_fallback_total{kernel,
reason}``. Reasons for ``all``: ``not_built`` (installed without a
compiler), ``stale`` (built from older C++ sources or another torch: ``make kernels``),
``isa_unsupported`` (no AVX2 + FMA, or no level built that this CPU runs),
``load_failed`` (the library would not open), ``build_in_progress`` (a build held its lock
past the timeout), ``disabled`` (``KVSTACK_NO_KERNELS``; ``KVSTACK_ISA=avx2``, or any
level name, caps the level loaded so that an AVX-512 machine runs and tests the AVX2
kernels: an unknown name is ``isa_unsupported``); and per-kernel ones such as
``encoded_cache`` (a codec with no kernel view; every built-in codec has one, and the
codec kernel has a portable path for every CPU and head size, so none falls back on an
ISA) or
``bf16_unsupported`` (oneDNN has no native bf16 on this CPU: AVX2-only CPUs, where
``Linear`` runs the AVX2 kernel or a float32 GEMM of widened copies instead, and AVX-512
CPUs without BF16 or AMX, where it runs the AVX-512F widening kernel).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Any

from kvstack.core import hugepages
from kvstack.model.kernels import isa
from kvstack.model.kernels.files import (
    LockTimeout,
    kernel_dir,
    locked,
    read_manifest,
    sources_hash,
    stale_reason,
)

logger = logging.getLogger("kvstack.kernels")

_lock = threading.Lock()
_module: Any = None  # torch.ops.kvstack once loaded
_failed = False
_fallbacks: Counter[tuple[str, str]] = Counter()
_state = "not loaded"  # one line for ``kvstack doctor``: the level loaded, or why none


def kernels_disabled() -> bool:
    return os.environ.get("KVSTACK_NO_KERNELS", "") not in ("", "0")


def kernel_state() -> str:
    """What ``load_kernels`` did: ``"avx512_bf16 (<path>)"``, or why no kernels run."""
    return _state


def note_fallback(kernel: str, reason: str, count: int = 1, message: str | None = None) -> None:
    """Count a use of the PyTorch path where ``kernel`` was meant to run (the first time
    per pair, one warning: ``message`` if given, else kernel and reason)."""
    key = (kernel, reason)
    if key not in _fallbacks:
        if message is None:
            logger.warning("kernel %s falls back to PyTorch: %s", kernel, reason)
        else:
            logger.warning("%s", message)
    _fallbacks[key] += count


def fallback_counts() -> dict[tuple[str, str], int]:
    """``(kernel, reason) -> count`` since the process started (a copy), with the huge-page
    chunks left on ordinary pages as kernel ``hugepages`` (``kvstack/core/hugepages.py``)."""
    counts = dict(_fallbacks)
    for reason, n in hugepages.fallback_counts().items():
        counts[("hugepages", reason)] = n
    return counts


Kernels = Any  # the ``torch.ops.kvstack`` namespace (ops declared in csrc/bindings.cpp)


def direct(op: Any) -> Any:
    """The C++ callable behind a ``torch.ops`` packet (``OpOverloadPacket._op``), else
    ``op``: calling it skips one Python frame per call (a batch-1 decode token makes
    ~300 op calls, so the frames add up to a share of a ~10 ms token)."""
    fn = getattr(op, "_op", None)
    return fn if callable(fn) else op


def load_kernels() -> Kernels | None:
    """``torch.ops.kvstack`` with the built kernels of the best ISA level this CPU runs,
    or None when unavailable (never raises, never compiles: one warning naming the reason,
    counted in ``kvstack:kernel_fallback_total``)."""
    global _module, _failed, _state
    if kernels_disabled():
        note_fallback("all", "disabled")
        _state = "off: KVSTACK_NO_KERNELS is set"
        return None
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            _module = _open()
            _failed = _module is None
    return _module


def _give_up(reason: str, why: str) -> None:
    global _state
    _state = f"off: {why}"
    note_fallback("all", reason, message=f"C++ kernels off ({why}); using the PyTorch path")


def _open() -> Kernels | None:
    """Choose the level (``isa.choose_level``) and load its library; None on any failure."""
    global _state
    import torch

    flags = isa.cpu_flags()
    if not isa.runnable(flags):
        _give_up("isa_unsupported", "this CPU has no AVX2 + FMA (x86-64-v3)")
        return None
    directory = kernel_dir()
    path = directory
    try:
        with locked(directory, exclusive=False, on_wait=_waiting):
            manifest = read_manifest(directory)
            if manifest is None:
                _give_up("not_built", f"not built in {directory}: run `make kernels`")
                return None
            stale = stale_reason(manifest, sources_hash(), torch.__version__)
            if stale is not None:
                _give_up("stale", f"{stale}: run `make kernels` to rebuild")
                return None
            cap = os.environ.get(isa.ISA_ENV, "").strip()
            if cap and cap not in isa.LEVEL_NAMES:
                known = ", ".join(isa.LEVEL_NAMES)
                _give_up("isa_unsupported", f"{isa.ISA_ENV}={cap!r} is no ISA level ({known})")
                return None
            chosen = isa.choose_level(flags, isa.capped(manifest.levels, cap))
            if chosen is None:
                built = ", ".join(isa.capped(manifest.levels, cap))
                _give_up("isa_unsupported", f"this CPU runs none of the levels built ({built})")
                return None
            path = manifest.library(directory, chosen.name)
            torch.ops.load_library(str(path))
    except LockTimeout as exc:
        _give_up("build_in_progress", str(exc))
        return None
    except Exception as exc:  # a missing or corrupt library, an undefined symbol, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _give_up("load_failed", f"{path.name} failed to load: {first}")
        return None
    isa.set_active(chosen)
    _state = f"{chosen.name} ({path})"
    logger.info("C++ kernels: ISA level %s (%s) from %s", chosen.name, chosen.summary, path)
    return torch.ops.kvstack


def _waiting(pid: str) -> None:
    logger.warning("waiting for the C++ kernel build in progress (pid %s) to finish", pid)
