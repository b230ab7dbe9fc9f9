"""Checks of the packed GGUF types that are 8-bit codes (Q5_0: groups of 32, Q6_K: groups
of 16) on every kernel the loaded ISA level has, against their dequantized reference:
``quant_dequant`` bit for bit, ``quant_linear`` (float sums), ``quant_linear_vnni`` and
``quant_gemv`` (int8 activations, llama.cpp's arithmetic) and ``QuantLinear``'s choice, at
M = 1, 5 (decode) and 40 (prefill), bf16 and float32. ``run_level`` runs them in a fresh
interpreter with ``KVSTACK_ISA`` capping the level (a process loads one library), so an
AVX-512 machine checks the AVX2 kernels too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from kvstack.model.kernels import isa
from kvstack.model.quant.gguf_blocks import pack_gguf
from kvstack.model.quant.linear import QuantLinear
from kvstack.model.quant.packed import PackedWeight, dequantize_reference
from kvstack.model.quant.tiled import tile_weight

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]
ROWS = (1, 5, 40)
SHAPES = (("Q5_0", 48, 896), ("Q6_K", 32, 768), ("Q6_K", 16, 1536))


def random_gguf(qtype: str, n: int, k: int, seed: int) -> PackedWeight:
    """A random ``[n, k]`` weight packed from GGUF bytes: gguf-py's quantizer for Q5_0;
    random bytes for Q6_K (every code and int8 sub-scale, a sane fp16 d)."""
    rng = np.random.default_rng(seed)
    if qtype == "Q6_K":
        blocks = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
        d = (rng.uniform(0.5, 2, size=(n, k // 256)) / (32 * 64 * np.sqrt(k))).astype(np.float16)
        blocks[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
        raw = blocks.reshape(n, -1)
    else:
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        raw = np.asarray(gguf.quants.quantize(w, Q[qtype]))
    packed = pack_gguf(raw, int(Q[qtype]))
    assert packed is not None and packed.bits == 8
    want = np.asarray(gguf.quants.dequantize(raw, Q[qtype]), dtype=np.float32).reshape(n, k)
    assert torch.equal(dequantize_reference(packed), torch.from_numpy(want))
    return packed


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's activation rounding (block_q8_0: per 32 values, scale max|x| / 127)."""
    m, k = x.shape
    c = x.float().reshape(m, k // 32, 32)
    d = c.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(c * inv) * d).reshape(m, k)


def _close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.float() - want).abs()
    assert bool((err <= bound + want.abs() * 2**-8 + 1e-30).all()), (what, float(err.max()))


def check_weight(k: Any, w: PackedWeight, what: str) -> set[str]:
    """Every kernel of this level on ``w``; returns what ``QuantLinear`` chose in bf16."""
    n, kk = w.out_features, w.in_features
    g = torch.Generator().manual_seed(n + kk)
    x32 = torch.randn(max(ROWS), kk, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ref_w = dequantize_reference(w, dtype)
        assert torch.equal(k.quant_dequant(w.q, w.scale, w.min, w.group, 8, dtype), ref_w), what
        x = x32.to(dtype)
        want = F.linear(x.float(), ref_w.float())
        bound = (x.float().abs() @ ref_w.float().abs().T) * (kk * 2**-23)
        for m in ROWS:
            got = k.quant_linear(x[:m], w.q, w.scale, w.min, w.group, 8)
            _close(got, want[:m], bound[:m], f"{what} quant_linear {dtype} M={m}")
    x = x32.to(torch.bfloat16)
    ref_w = dequantize_reference(w)
    xq = int8_activations(x)
    want = F.linear(xq, ref_w)
    bound = (xq.abs() @ ref_w.abs().T) * (kk * 2**-22)
    if k.quant_linear_vnni_ok(kk, w.group, 8):
        for m in ROWS:
            got = k.quant_linear_vnni(x[:m], w.q, w.scale, w.min, w.group, 8)
            _close(got, want[:m], bound[:m], f"{what} quant_linear_vnni M={m}")
    if k.quant_gemv_ok(n, kk, w.group, 8):
        t = tile_weight(w)
        for m in ROWS:
            got = k.quant_gemv(x[:m], t.codes, t.scale, t.min, t.group, t.bits)
            _close(got, want[:m], bound[:m], f"{what} quant_gemv M={m}")
    chose = set()
    for dtype in (torch.float32, torch.bfloat16):
        lin = QuantLinear(w, dtype, k)
        ref = F.linear(x32.to(dtype).float(), dequantize_reference(w, dtype).float())
        loose = (x32.abs() @ dequantize_reference(w).abs().T) * 2**-6
        for m in ROWS:  # decode rows, then (M = 40 > PREFILL_ROWS) dequantize + GEMM
            _close(lin(x32[:m].to(dtype)), ref[:m], loose[:m], f"{what} {lin.kernel} M={m}")
        if dtype == torch.float32:
            assert lin.kernel == "quant_linear", what  # exact weights, float sums
        else:
            chose.add(lin.kernel)
    return chose


def check_level(k: Any) -> dict[str, set[str]]:
    """Every shape of ``SHAPES`` on kernels ``k``; ``{type: kernels QuantLinear chose}``."""
    chose: dict[str, set[str]] = {}
    for i, (qtype, n, kk) in enumerate(SHAPES):
        w = random_gguf(qtype, n, kk, seed=i)
        chose.setdefault(qtype, set()).update(check_weight(k, w, f"{qtype} {n}x{kk}"))
    return chose


def expected_bf16_kernel(k: Any) -> str:
    """What bf16 decode rows of an 8-bit GGUF weight (groups of 32 or 16) take at the
    loaded level: the int8 dot product wherever the level has one (AVX512-VNNI:
    ``quant_gemv``; AVX2: ``quant_linear_vnni``), else the float kernel."""
    if isa.at_least("avx512_bf16"):
        assert k.quant_gemv_ok(16, 64, 16, 8) and k.quant_gemv_ok(16, 64, 32, 8)
        return "quant_gemv"
    if isa.int8_dot_is_avx2():
        assert k.quant_linear_vnni_ok(64, 16, 8) and k.quant_linear_vnni_ok(64, 32, 8)
        return "quant_linear_vnni"
    return "quant_linear"


SCRIPT = """
import sys
from kvstack.model.kernels import isa
from kvstack.model.kernels.loader import load_kernels
import quant_types_util as u
k = load_kernels()
assert k is not None and isa.active() is not None and isa.active().name == sys.argv[1], isa.active()
chose = u.check_level(k)
assert all(c == {u.expected_bf16_kernel(k)} for c in chose.values()), chose
print("level", sys.argv[1], sorted(chose.items()))
"""


def run_level(name: str) -> str:
    """``check_level`` in a fresh interpreter at ISA level ``name`` (its stdout)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    env[isa.ISA_ENV] = name
    env.pop("KVSTACK_NO_KERNELS", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, name], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
