"""Q5_0 and Q6_K kept packed (8-bit codes) against their dequantized dense linear, one layer.

Shapes of the Qwen2.5-Coder GGUFs: the 0.5B's Q5_0 gate_up 9728x896 and down 896x4864
(Q6_K in half its layers), the 1.5B's Q6_K down 1536x8960. For M = 1 and 4 rows, ms per
call (minimum of ``--reps`` after a warm-up, all candidates in one process):

- ``bf16_dense`` / ``f32_dense``: the weight dequantized at load, kvstack's ``Linear``
  (oneDNN; what ``--quantization gguf`` ran for these types before they were packed);
- ``QuantLinear_bf16`` / ``QuantLinear_f32``: what ``--quantization gguf`` runs now (the
  kernel it picks is printed);
- ``quant_linear_*``, ``vnni``, ``gemv``: each kernel this ISA level has, called directly.

``KVSTACK_ISA=avx2`` runs the AVX2 kernels on an AVX-512 CPU (a fresh process per level).

    PYTHONPATH=src python benchmarks/gguf_types.py [--reps 50] [--threads 2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch

from bench_common import best_ms
from kvstack.model.arch.layers import Linear
from kvstack.model.kernels import isa
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.quant.gguf_blocks import pack_gguf
from kvstack.model.quant.linear import QuantLinear
from kvstack.model.quant.packed import PackedWeight, dequantize_reference
from kvstack.model.quant.tiled import tile_weight

SHAPES = {
    "Q5_0 gate_up 0.5B": ("Q5_0", 9728, 896),
    "Q5_0 down 0.5B": ("Q5_0", 896, 4864),
    "Q6_K down 0.5B": ("Q6_K", 896, 4864),
    "Q6_K down 1.5B": ("Q6_K", 1536, 8960),
}


def packed(qtype: str, n: int, k: int) -> PackedWeight:
    rng = np.random.default_rng(0)
    if qtype == "Q6_K":  # gguf-py has no Q6_K quantizer: random blocks, a sane d
        blocks = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
        blocks[..., 208:210] = np.array([1e-4], np.float16).view(np.uint8)
        raw = blocks.reshape(n, -1)
    else:
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        raw = np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]))
    p = pack_gguf(raw, int(gguf.GGMLQuantizationType[qtype]))
    assert p is not None
    return p


def candidates(p: PackedWeight, m: int, k: Any) -> tuple[dict[str, Callable[[], object]], str]:
    g = torch.Generator().manual_seed(1)
    x32 = torch.randn(m, p.in_features, generator=g)
    xb = x32.bfloat16()
    out: dict[str, Callable[[], object]] = {}
    for name, x, dtype in (("bf16", xb, torch.bfloat16), ("f32", x32, torch.float32)):
        dense = Linear(dequantize_reference(p, dtype), dtype)
        lin = QuantLinear(p, dtype, k)
        out[f"{name}_dense"] = lambda dense=dense, x=x: dense(x)
        out[f"QuantLinear_{name}"] = lambda lin=lin, x=x: lin(x)
        out[f"quant_linear_{name}"] = lambda x=x: k.quant_linear(x, p.q, p.scale, None, p.group, 8)
        if name == "bf16":
            chose = lin.kernel
    if k.quant_linear_vnni_ok(p.in_features, p.group, 8):
        out["vnni"] = lambda: k.quant_linear_vnni(xb, p.q, p.scale, None, p.group, 8)
    if k.quant_gemv_ok(p.out_features, p.in_features, p.group, 8):
        t = tile_weight(p)
        out["gemv"] = lambda: k.quant_gemv(xb, t.codes, t.scale, None, t.group, 8)
    return out, chose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = load_kernels()
    if k is None:
        raise SystemExit("the C++ kernels are not built")
    active = isa.active()
    print(f"CPU {isa.cpu_model()}, ISA level {active.name if active else None}, "
          f"{args.threads} thread(s), min of {args.reps}")  # fmt: skip
    for label, (qtype, n, kk) in SHAPES.items():
        p = packed(qtype, n, kk)
        for m in map(int, args.ms.split(",")):
            fns, chose = candidates(p, m, k)
            times = {name: best_ms(fn, args.reps) for name, fn in fns.items()}
            cells = " ".join(f"{c}={t:.3f}" for c, t in times.items())
            ratio = times["bf16_dense"] / times["QuantLinear_bf16"]
            print(f"{label:18s} {n}x{kk} M={m} bf16 -> {chose} ({ratio:.2f}x dense bf16) {cells}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
