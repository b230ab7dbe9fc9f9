"""bf16 linears on Intel AMX tiles for decode-sized batches (``csrc/amx_linear.cpp``).

oneDNN (``mkldnn._linear_pointwise`` on prepacked weights) runs a linear at M = 1..128
rows well below the speed of reading its weights once: at M = 32 on the 2-core AMX Xeon
of issue 15 it reached ~217 GFLOP/s for two cores where one core's TDPBF16PS peak is
~1.7 TFLOP/s (``benchmarks/profile_step.py`` measures both). ``amx_linear`` streams each
weight tile once per 32 rows with a plain K loop; ``Linear`` sends a bf16 input of at
most ``AMX_MAX_ROWS`` rows to it and longer ones (prefill) to oneDNN, which is faster
there (its blocking is tuned for large M).

Weight layout (``pack_weight``; the kernel's comment has the derivation)::

    packed[nb, kb, kp, n, j] = W[16 nb + n, 32 kb + 2 kp + j]     (VNNI B tiles, 1 KiB each)

Invariants: only bf16 weights with ``in_features % 32 == 0`` and ``out_features % 16
== 0`` are packed (other shapes stay on oneDNN; every Llama-family width kvstack loads
today qualifies); the packed copy holds the same bf16 values as the weight, so the only
difference from oneDNN's output is float32 summation order before the one rounding to
bf16. Availability is decided once per process (``amx_linear_available``: compiled with
AMX and the kernel granted the tile state by ``arch_prctl``); where it is False nothing is
packed and no fallback is counted, since oneDNN is the designed path there.
"""

from __future__ import annotations

import torch

from kvstack.model.kernels import Kernels, load_kernels

AMX_MAX_ROWS = 128  # rows (tokens) up to which amx_linear beats oneDNN (measured, see README)

_available: bool | None = None


def amx_kernels() -> Kernels | None:
    """``torch.ops.kvstack`` when its AMX linear can run in this process, else None."""
    global _available
    kernels = load_kernels()
    if kernels is None:
        return None
    if _available is None:
        _available = bool(kernels.amx_linear_available())
    return kernels if _available else None


def packable(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return weight.dtype == torch.bfloat16 and in_features % 32 == 0 and out_features % 16 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` bf16 -> the kernel's tile order (a permuted contiguous copy)."""
    n, k = weight.shape
    assert packable(weight), (weight.dtype, weight.shape)
    return weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_weight`` (tests)."""
    nb, kb, _, _, _ = packed.shape
    return packed.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)


def fits(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to the AMX kernel: 2-D bf16, contiguous rows, <= AMX_MAX_ROWS."""
    return x.dim() == 2 and x.shape[0] <= AMX_MAX_ROWS and x.stride(1) == 1
