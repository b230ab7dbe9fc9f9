"""bf16 linears on Intel AMX tiles for decode-sized batches (``csrc/amx_linear.cpp``).

oneDNN (``mkldnn._linear_pointwise`` on prepacked weights) runs a linear at M = 1..128
rows well below the speed of reading its weights once: at M = 32 on a 2-core AMX Xeon
it reached ~217 GFLOP/s for two cores where one core's TDPBF16PS peak is
~1.7 TFLOP/s (``benchmarks/profile_step.py`` measures both). ``amx_linear`` streams each
weight tile once per 32 rows with a plain K loop. ``Linear`` asks ``use_amx`` which
kernel takes an input; the rule follows one-thread measurements on that Xeon (minimum of
15-30 repetitions, GFLOP/s, oneDNN vs AMX, ``README``: Performance):

    rows (M)   576->960   576->576   576->3072   1536->576   576->49152 (lm_head)
    32         1.76x      2.17x      1.34x       1.55x       1.63x
    128        1.26x      1.32x      1.01x       2.36x       0.84x
    2048       0.82x      2.26x      0.64x       ~2.5x       -

so: every input of up to 32 rows; up to ``AMX_MAX_ROWS`` rows unless the layer is wider
than ``WIDE_OUT`` (the lm_head, where oneDNN's blocking wins from 128 rows); and any
number of rows when the layer's input is at least ``DEEP_IN`` wide (a down projection:
oneDNN ran 1536 -> 576 at 410-470 GFLOP/s for 2,048 rows, AMX at ~1,000-1,100).

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

from kvstack.model.kernels import isa
from kvstack.model.kernels.loader import Kernels, load_kernels

AMX_MAX_ROWS = 128  # rows (tokens) up to which amx_linear beats oneDNN (table above)
ALWAYS_ROWS = 32  # up to this many rows AMX wins for every shape measured
WIDE_OUT = 8192  # out_features past which oneDNN wins beyond ALWAYS_ROWS rows
DEEP_IN = 1024  # in_features from which AMX wins at every row count measured

_available: bool | None = None


def amx_kernels() -> Kernels | None:
    """``torch.ops.kvstack`` when its AMX linear can run in this process, else None."""
    global _available
    kernels = load_kernels()
    if kernels is None:
        return None
    if _available is None:  # the AMX build is loaded, and the OS grants the tile state
        _available = isa.amx_level() and bool(kernels.amx_linear_available())
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


def use_amx(x: torch.Tensor, out_features: int) -> bool:
    """Whether ``x`` (2-D bf16, rows contiguous) goes to the AMX kernel (rule above)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.bfloat16:
        return False
    rows, in_features = x.shape
    if rows <= ALWAYS_ROWS or in_features >= DEEP_IN:
        return True
    return rows <= AMX_MAX_ROWS and out_features <= WIDE_OUT
