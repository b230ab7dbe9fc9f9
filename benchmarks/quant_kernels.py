"""Which weight-only linear wins at which M: one thread, min of many repetitions, one process.

For the default model's shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
lm_head 49152x576) and M = 1, 4, 16, 32, 64, 256, 512 bf16 rows, times per call of:

- ``bf16_onednn``: the dense bf16 weight prepacked for oneDNN (kvstack's ``Linear``);
- ``kvstack_Q4_1`` / ``kvstack_Q8_0`` / ``kvstack_int8``: ``torch.ops.kvstack.quant_linear``
  (float activations, weights dequantized in registers);
- ``kvstack_vnni_*``: ``quant_linear_vnni`` (int8 activations; AVX512-VNNI dot products,
  or vpmaddubsw on a CPU without AVX-512);
- ``kvstack_gemv_*``: ``quant_gemv`` over the 16-row tile copy (int8 activations,
  AVX512-VNNI only);
- ``dequant_onednn_Q4_1``: ``quant_dequant`` to bf16 + ``F.linear`` (kvstack's prefill path);
- ``torch_int4pack``: PyTorch's ``_weight_int4pack_mm_for_cpu`` (gpt-fast's int4, group 32);
- ``torch_int8pack``: PyTorch's ``_weight_int8pack_mm`` (gpt-fast's int8 per channel).

One thread (``torch.set_num_threads(1)``) and the minimum over repetitions, so other
tenants of a shared machine disturb the comparison least; all candidates run in this one
process, interleaved per shape. Prints the CPU and its ISA flags; JSON (with the machine)
to ``benchmarks/results/quant_kernels<tag>.json``.

    PYTHONPATH=src python benchmarks/quant_kernels.py [--reps 30] [--threads 1] [--tag -epyc]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from bench_common import RESULTS_DIR, best_ms
from kvstack.model.arch.layers import Linear
from kvstack.model.kernels.loader import load_kernels
from kvstack.model.quant.gguf_blocks import pack_gguf
from kvstack.model.quant.packed import PackedWeight, unpack_u4
from kvstack.model.quant.quantize import quantize_int4, quantize_int8
from kvstack.model.quant.tiled import tile_weight
from offline_throughput import machine_info

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # fmt: skip
MS = (1, 4, 16, 32, 64, 256, 512)


def torch_int4(w: torch.Tensor, x: torch.Tensor) -> Callable[[], object] | None:
    """gpt-fast's int4 path: codes 0..15, (scale, zero) with w = (q - 8) * scale + zero."""
    try:
        q4 = quantize_int4(w)
        codes = unpack_u4(q4.q).to(torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        assert q4.min is not None
        zero = q4.min + 8 * q4.scale
        sz = torch.stack([q4.scale.T, zero.T], dim=-1).contiguous().to(x.dtype)
        fn = lambda: torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)  # noqa: E731
        fn()
        return fn
    except (RuntimeError, AttributeError, TypeError):
        return None


def candidates(w: torch.Tensor, x: torch.Tensor, k: Any) -> dict[str, Callable[[], object]]:
    dense = Linear(w, torch.bfloat16)
    out: dict[str, Callable[[], object]] = {"bf16_onednn": lambda: dense(x)}
    packs: dict[str, PackedWeight] = {"int8": quantize_int8(w), "int4": quantize_int4(w)}
    for name in ("Q4_1", "Q8_0"):
        qt = gguf.GGMLQuantizationType[name]
        raw = np.asarray(gguf.quants.quantize(w.float().numpy(), qt))
        p = pack_gguf(raw, int(qt))
        assert p is not None
        packs[name] = p
    for name, p in packs.items():
        out[f"kvstack_{name}"] = (lambda p=p: k.quant_linear(x, p.q, p.scale, p.min, p.group,
                                                             p.bits))  # fmt: skip
        if k.quant_linear_vnni_ok(p.in_features, p.group, p.bits):
            out[f"kvstack_vnni_{name}"] = lambda p=p: k.quant_linear_vnni(
                x, p.q, p.scale, p.min, p.group, p.bits
            )
        if k.quant_gemv_ok(p.out_features, p.in_features, p.group, p.bits):
            t = tile_weight(p)
            out[f"kvstack_gemv_{name}"] = lambda t=t: k.quant_gemv(
                x, t.codes, t.scale, t.min, t.group, t.bits
            )
    q41 = packs["Q4_1"]
    out["dequant_onednn_Q4_1"] = lambda: F.linear(
        x, k.quant_dequant(q41.q, q41.scale, q41.min, q41.group, 4, torch.bfloat16)
    )
    i4 = torch_int4(w, x)
    if i4 is not None:
        out["torch_int4pack"] = i4
    w8 = packs["int8"]
    s8 = w8.scale.reshape(-1).to(x.dtype)
    try:
        torch._weight_int8pack_mm(x, w8.q, s8)
        out["torch_int8pack"] = lambda: torch._weight_int8pack_mm(x, w8.q, s8)
    except RuntimeError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--tag", default="", help="suffix of the JSON file name, e.g. -epyc")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    flags = " ".join(info.get("cpu_flags", []))
    print(f"CPU {info.get('cpu_model')} ({flags}), commit {info.get('git_commit')}, "
          f"{args.threads} thread(s), min of {args.reps}")  # fmt: skip
    k = load_kernels()
    if k is None:
        raise SystemExit("the C++ kernels did not build")
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        n, kk = SHAPES[shape]
        w = torch.randn(n, kk, generator=g) / kk**0.5
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, kk, generator=g).to(torch.bfloat16)
            times = {name: best_ms(fn, args.reps) for name, fn in candidates(w, x, k).items()}
            win = min(times, key=lambda c: times[c])
            rows.append({"shape": shape, "N": n, "K": kk, "M": m, "ms": times, "fastest": win})
            cells = " ".join(f"{c}={t:.3f}" for c, t in times.items())
            print(f"{shape:8s} M={m:4d} fastest {win:20s} {cells}", flush=True)
    doc = {"threads": args.threads, "reps": args.reps, "statistic": "min", "rows": rows,
           "torch": torch.__version__, "machine": info}  # fmt: skip
    path = RESULTS_DIR / f"quant_kernels{args.tag}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
