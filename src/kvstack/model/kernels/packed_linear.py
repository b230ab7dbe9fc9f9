"""Which of kvstack's own bf16 linear kernels runs on this CPU, and for which inputs.

The kernels read the weight in one packed copy (``amx_linear.pack_weight``: for each block
of 16 output columns, consecutive bf16 pairs of K) and round a float32 accumulator to bf16
once; they beat oneDNN where it is compute-starved (decode-sized batches), and ``Linear``
keeps oneDNN's prepacked weight for the inputs a kernel's rule does not take:

- ``amx`` (``csrc/amx_linear.cpp``): Intel AMX tiles; rule in ``model/kernels/amx_linear.py``
  (measured on a 2-core AMX Xeon);
- ``avx512_bf16`` (``csrc/bf16_linear.cpp``): register-blocked ``VDPBF16PS`` for CPUs with
  AVX512-BF16 and no AMX (AMD EPYC Zen 4/5). It takes **every** bf16 input, so a row's
  output never depends on how many rows share its step (batch invariance, below).
  ``benchmarks/linear_kernels.py`` on the 2-core AMD EPYC (Zen 5) of 2026-12-05, two
  threads, minimum of 15, oneDNN time / kernel time
  (``results/linear_kernels-2026-12-05-zen5-invariance.json``):

      rows (M)   576->960   576->576   576->3072   1536->576   576->49152 (lm_head)
      1          2.48x      2.93x      1.37x       2.03x       1.05x
      32         1.35x      1.50x      1.09x       1.29x       1.05x
      128        1.06x      1.11x      1.02x       1.05x       1.00x
      256        1.04x      1.05x      1.00x       1.03x       0.96x
      512        1.00x      1.01x      0.99x       1.01x       1.00x
      2048       0.99x      0.99x      0.99x       1.00x       1.01x

  From 256 rows the kernel splits rows, not columns, between threads (``kRowSplitRows``):
  in a prefill each thread's rows of x were just written into its own core's cache by the
  previous op, and a column split had every thread read all of x: inside the engine that
  made the projections 3-12 % slower than oneDNN at 2,048 rows although this table (x
  warm in both caches) showed parity; with the split they ran within 2 % of it there.
  ``benchmarks/batch_invariance.py`` (offline 32 prompts x 256 tokens -> 64, both rules
  interleaved in one process, medians of 3): 0.985x the old routing's throughput, 1.006x
  in an earlier pair of the same workload (run-to-run spread). On the Zen 4 of
  2026-12-02 (minimum of 30) the kernel ran a batch-32 decode step near the ``VDPBF16PS``
  peak (~220 GFLOP/s a core). Until 2026-12-05 inputs of more than 64 rows (192 for layers
  no wider than ``WIDE_OUT``) went to oneDNN,
  whose float32 summation order differs: a request's greedy text could change when a long
  prompt shared its step.

- ``avx2_fma`` (the same ``csrc/bf16_linear.cpp`` over ``csrc/fma_bf16.h``): CPUs with only
  AVX2 + FMA (AMD EPYC Zen 2/3), where oneDNN has no bf16. PyTorch 2.13
  has no fast bf16 matmul there (oneDNN's bf16 needs AVX512/AMX; ``F.linear`` in bf16 ran
  at 7-8 GFLOP/s on the 2-core AMD EPYC Zen 3 of 2026-12-02 against 44-108 in float32).
  The kernel widens each weight pair to float32 in registers (exact) and runs FMAs.
  Against MKL's float32 GEMM on copies widened per call (``widened_linear``), same CPU, two
  threads, minimum of 15, widened time / kernel time:

      rows (M)   576->960   1536->576   576->3072   576->49152 (lm_head)
      1          8.5x       8.6x        12.7x       29.8x
      32         2.2x       2.0x        2.4x        4.3x
      128        0.92x      1.07x       1.03x       2.1x
      256        0.78x      0.79x       0.87x       1.9x
      512        0.58x      0.69x       0.92x       0.95x

  so the kernel takes every input of up to ``AVX2_MAX_ROWS`` rows and the lm_head (wider
  than ``WIDE_OUT``, whose widened copy costs more than the GEMM) at any size; ``Linear``
  sends the rest to ``widened_linear``.

- ``avx512_fma`` (the same ``csrc/bf16_linear.cpp`` over ``csrc/fma512_bf16.h``): CPUs with
  AVX-512F but neither AVX512-BF16 nor AMX (Skylake-SP .. Ice Lake Xeons; the 2-core Intel
  Xeon of 2026-12-02 is a VM that hides both flags). oneDNN converts bf16 in software
  there (35-63 GFLOP/s); the kernel widens each weight pair in registers and runs 16-lane
  FMAs. ``benchmarks/linear_kernels.py`` on that Xeon, two threads, minimum of 10, warm
  weights, oneDNN time / kernel time (and / ``widened_linear`` time):

      rows (M)   576->960       576->3072      1536->576      576->49152 (lm_head)
      1          1.90 (0.53)    1.79 (0.23)    2.04 (0.37)    1.50 (0.05)
      32         3.48 (1.77)    4.59 (2.37)    4.57 (2.06)    4.92 (0.80)
      128        3.83 (3.28)    4.44 (3.94)    3.32 (3.69)    4.61 (2.00)
      512        4.54 (2.46)    3.89 (5.04)    4.40 (4.60)    4.39 (2.90)

  so the kernel takes every bf16 input (``widened_linear`` is at best 1.3x faster, at 512
  rows of the gate/up projection, and up to 20x slower at decode sizes).

AMX wins over AVX512-BF16 where both exist (a tile instruction does 16x the work of a
``VDPBF16PS``), so it is chosen first. Invariant: a kernel is chosen once per process
(``tile_kernel``), so every ``Linear`` of a model routes the same way; float32 models never
use either (``F.linear``, bit-comparable with transformers).

**Batch invariance** (bf16): each kernel sums a row's products in one fixed order whatever
the number of rows (``tests/model/test_bf16_linear.py``), so where it takes every input
(``TileKernel.batch_invariant``: ``avx512_bf16``, ``avx512_fma``) a step's batch mates,
chunk sizes and prefix hits change no bit of a request's logits
(``tests/engine/test_batch_invariance.py``). ``amx`` and ``avx2_fma`` still hand long
inputs to oneDNN / ``widened_linear``, where each wins (tables above), so on those CPUs a
bf16 row's last bit can depend on its batch mates, as in vLLM without
``VLLM_BATCH_INVARIANT``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstack.model.kernels import amx_linear, isa
from kvstack.model.kernels.isa import onednn_bf16
from kvstack.model.kernels.loader import direct, load_kernels

AVX2_MAX_ROWS = 128  # rows up to which the AVX2 + FMA kernel beats float32 MKL (above)
WIDE_OUT = amx_linear.WIDE_OUT

_chosen: TileKernel | None = None
_decided = False


@dataclass(frozen=True)
class TileKernel:
    """One kernel over the packed weight: ``op(x, packed, out_features)``; ``use(x, out)``
    says whether an input goes to it (else oneDNN)."""

    name: str
    op: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    use: Callable[[torch.Tensor, int], bool]
    batch_invariant: bool = False  # ``use`` takes every bf16 input (no oneDNN split)


def use_avx2(x: torch.Tensor, out_features: int) -> bool:
    """Whether ``x`` (2-D bf16, rows contiguous) goes to the AVX2 + FMA kernel."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.bfloat16:
        return False
    return x.shape[0] <= AVX2_MAX_ROWS or out_features > WIDE_OUT


def use_every(x: torch.Tensor, out_features: int) -> bool:
    """Whether ``x`` goes to the ``avx512_bf16`` or ``avx512_fma`` kernel: every 2-D bf16
    input with contiguous rows (rules above: batch invariant)."""
    return x.dim() == 2 and x.stride(1) == 1 and x.dtype == torch.bfloat16


def widened_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for bf16 operands through float32 GEMM (MKL): exact products and
    float32 sums rounded to bf16 once, like the kernels; for CPUs where PyTorch's own bf16
    matmul is the slow generic loop (no oneDNN bf16)."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def tile_kernel() -> TileKernel | None:
    """The bf16 linear kernel this process uses for decode-sized inputs, or None (no kernel
    build, or none of AMX, AVX512-BF16, AVX2 + FMA: oneDNN or ``F.linear`` runs everything,
    by design, uncounted)."""
    global _chosen, _decided
    if _decided:
        return _chosen
    ops = load_kernels()
    _chosen = None
    if ops is not None:  # the ISA choice is model/kernels/isa.py's
        amx = amx_linear.amx_kernels() is not None
        name = isa.tile_kernel_name(str(ops.bf16_linear_isa()), amx, onednn_bf16())
        if name == "amx":
            _chosen = TileKernel("amx", direct(ops.amx_linear), amx_linear.use_amx)
        elif name in ("avx512_bf16", "avx512_fma"):
            _chosen = TileKernel(name, direct(ops.bf16_linear), use_every, True)
        elif name == "avx2_fma":
            _chosen = TileKernel(name, direct(ops.bf16_linear), use_avx2)
    _decided = True
    return _chosen
