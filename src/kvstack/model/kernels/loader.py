"""Optional C++ kernels, compiled on first use with ``torch.utils.cpp_extension``.

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
``quant_gemv.cpp`` over 16-row weight tiles on AVX512-VNNI). The build takes ~30-90 s
(~5 min on a 2-core AVX2-only EPYC) once per machine and is cached under
``~/.cache/kvstack/kernels-<cpu>`` (or ``$KVSTACK_KERNEL_DIR``), one directory per CPU
model and flag set. ``KVSTACK_NO_KERNELS=1`` forces the PyTorch path (tests compare both).

Fallbacks are never silent: every time the engine takes the PyTorch path where a kernel
was meant to run, ``note_fallback(kernel, reason)`` counts it (one warning per pair, the
first time) and the server exports the counts as ``kvstack:kernel_fallback_total{kernel,
reason}``. Reasons: ``build_failed`` (compiler or headers missing), ``disabled``
(``KVSTACK_NO_KERNELS``), and per-kernel ones such as ``encoded_cache`` (a codec with no
kernel view; every built-in codec has one, and the codec kernel has a portable path for
every CPU and head size, so none falls back on an ISA) or
``bf16_unsupported`` (oneDNN has no native bf16 on this CPU: AVX2-only CPUs, where
``Linear`` runs the AVX2 kernel or a float32 GEMM of widened copies instead, and AVX-512
CPUs without BF16 or AMX, where it runs the AVX-512F widening kernel).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvstack.core import hugepages

logger = logging.getLogger("kvstack.kernels")

_CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "bindings.cpp",
    "paged_attention.cpp",
    "paged_attention_codecs.cpp",
    "codec_write.cpp",
    "codec_gather.cpp",
    "kivi2_write.cpp",
    "fused_ops.cpp",
    "decode_stack.cpp",
    "decode_team.cpp",
    "token_mask.cpp",
    "argmax.cpp",
    "amx_linear.cpp",
    "bf16_linear.cpp",
    "prefill_attention.cpp",
    "quant_linear.cpp",
    "quant_vnni.cpp",
    "quant_gemv.cpp",
)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
_lock = threading.Lock()
_module: Any = None  # torch.ops.kvstack once loaded
_failed = False
_fallbacks: Counter[tuple[str, str]] = Counter()


def kernels_disabled() -> bool:
    return os.environ.get("KVSTACK_NO_KERNELS", "") not in ("", "0")


def cpu_signature() -> str:
    """A short hash of this CPU's model and ISA flags: the build uses ``-march=native``,
    so a build made on another CPU (an AMX Xeon's cache reused on an EPYC) must not load."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: one directory for the machine, as before
        return "any"
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return hashlib.sha256("\n".join(sorted(set(lines))).encode()).hexdigest()[:12]


def headers_hash() -> str:
    """A hash of ``csrc/*.h``: torch rebuilds when a source or a compiler flag changes, not
    when only a header does, so the headers' hash goes into the flags."""
    digest = hashlib.sha256()
    for header in sorted(_CSRC.glob("*.h")):
        digest.update(header.name.encode() + header.read_bytes())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    base = os.environ.get("KVSTACK_KERNEL_DIR") or str(Path.home() / ".cache" / "kvstack")
    path = Path(base) / f"kernels-{cpu_signature()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


STALE_LOCK_S = 15 * 60  # a build takes ~1-3 min; an older lock is a killed build's


def clear_stale_lock(directory: Path, now: float | None = None) -> bool:
    """Remove ``directory/lock`` when it is older than ``STALE_LOCK_S``: torch's build
    waits forever on the lock file a killed build left behind. Returns whether it did."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


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
    """``torch.ops.kvstack`` with the compiled kernels, or None when unavailable (never
    raises)."""
    global _module, _failed
    if kernels_disabled():
        note_fallback("all", "disabled")
        return None
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        try:
            import torch
            from torch.utils.cpp_extension import load

            logger.info("building kvstack C++ kernels (first use on this machine)...")
            clear_stale_lock(build_dir())
            load(
                name="kvstack_kernels",
                is_python_module=False,
                sources=[str(_CSRC / s) for s in SOURCES],
                extra_cflags=[*CFLAGS, f"-DKVSTACK_HEADERS_HASH={headers_hash()}"],
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(_CSRC)],
                build_directory=str(build_dir()),
                verbose=False,
            )
            _module = torch.ops.kvstack
        except Exception as exc:  # compiler missing, headers missing, ...
            _failed = True
            logger.warning("C++ kernels unavailable (%s); using the PyTorch fallback", exc)
            note_fallback("all", "build_failed")
    return _module
