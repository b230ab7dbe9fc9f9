"""The two roofline bounds of this machine, measured (never assumed): memory read
bandwidth and bf16 (or the model dtype's) GEMM throughput.

* bandwidth: bytes per second ``torch.sum`` reads from a float32 buffer of ``nbytes``
  with all threads; 256 MiB by default, larger than any L3 here, so the figure is DRAM's;
* GEMM throughput: FLOPs per second of the model's own ``gate_up`` linear (the largest
  GEMM of a layer, prepacked for oneDNN in bf16) at ``m`` rows; at M = 2048 it is the
  machine's practical compute peak for this model (AMX where the CPU has it).

Each figure is the best of ``runs`` timed calls after a warm-up (the least disturbed run
on a shared machine). ``benchmarks/roofline.py`` and ``kvstack profile`` use these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.model.quant.linear import QuantLinear, StackedLinear

BANDWIDTH_BYTES = 256 * 2**20


def best_time_s(fn: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """Shortest wall time of ``runs`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(nbytes: int = BANDWIDTH_BYTES, runs: int = 5) -> float:
    """Bytes per second ``torch.sum`` reads from a float32 buffer of ``nbytes``."""
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    return buf.numel() * 4 / best_time_s(buf.sum, runs)


def gemm_flops_per_s(layer: Any, m: int, dtype: torch.dtype, runs: int = 5) -> float:
    """GEMM throughput of ``layer`` (a ``kvstack.model.arch.layers.Linear``) at ``m`` rows."""
    n, k = layer.weight.shape
    x = torch.randn(m, k).to(dtype)
    return 2.0 * m * n * k / best_time_s(lambda: layer(x), runs)


@dataclass(frozen=True)
class MachineBounds:
    """Measured roofline of this machine for one model and dtype."""

    bandwidth_bytes_s: float  # DRAM read bandwidth
    peak_flops_s: float  # GEMM throughput at M = 2048 (the compute roof)
    gemm_m: dict[int, float]  # GEMM throughput at other M (the step sizes profiled)

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) where the compute roof meets the memory slope."""
        return self.peak_flops_s / self.bandwidth_bytes_s

    def attainable(self, intensity: float) -> float:
        """FLOP/s the roofline allows at ``intensity``."""
        return min(self.peak_flops_s, intensity * self.bandwidth_bytes_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bandwidth_gb_s": self.bandwidth_bytes_s / 1e9,
            "peak_gflop_s": self.peak_flops_s / 1e9,
            "gemm_gflop_s_at_m": {str(m): v / 1e9 for m, v in self.gemm_m.items()},
            "ridge_flop_per_byte": self.ridge,
        }


def measure_bounds(model: Any, ms: tuple[int, ...] = ()) -> MachineBounds:
    """Bandwidth and GEMM throughput with ``model``'s ``gate_up`` (peak at M = 2048); of a
    dense copy in the model dtype when the weights are quantized (``--quantization``)."""
    layer = model.layers[0].gate_up
    # (a dense Linear's ``packed`` is oneDNN's copy)
    if isinstance(layer, QuantLinear | StackedLinear):
        from kvstack.model.arch.layers import Linear

        layer = Linear(layer.dequantize(model.dtype), model.dtype)
    peak = gemm_flops_per_s(layer, 2048, model.dtype)
    at_m = {m: gemm_flops_per_s(layer, m, model.dtype) for m in sorted(set(ms))}
    return MachineBounds(read_bandwidth(), peak, at_m)
