"""``quant_gemv`` (``csrc/quant_gemv.cpp``) and its 16-row tile layout (``quant/tiled.py``):
the layout round-trips, the kernel matches the int8-activation reference (llama.cpp's
arithmetic, as ``quant_linear_vnni``) for every packed format at M = 1..17, a row never
depends on its batch mates, bad shapes are refused, and bf16 decode rows of a
``QuantLinear`` take it on an AVX512-VNNI CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.model.test_quant_linear import int8_activations, random_packed

from kvstack.model.kernels.loader import Kernels
from kvstack.model.quant import linear as quant_linear
from kvstack.model.quant.linear import QuantLinear
from kvstack.model.quant.packed import dequantize_reference, unpack_u4
from kvstack.model.quant.tiled import TILE, TiledWeight, tile_weight


def untile_codes(t: TiledWeight, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of ``tile_codes`` as plain codes ``[N, K]`` (int8 for 8 bits, 0..15 for 4):
    the tests check the layout with it."""
    n, k, tiles = out_features, in_features, out_features // TILE
    if t.bits == 8:
        u8 = t.codes.reshape(tiles, k // 4, TILE, 4).transpose(1, 2).reshape(n, k)
        return (u8.to(torch.int16) - 128).to(torch.int8)
    b = t.codes.reshape(tiles, k // 8, TILE, 4)
    nib = torch.stack([b & 15, b >> 4], dim=-1)  # [T, v, j, b, half]
    return nib.permute(0, 2, 1, 4, 3).reshape(n, k)


KINDS = [("Q4_1", 32, 576), ("Q4_0", 16, 128), ("Q8_0", 48, 192), ("Q4_K", 16, 512),
         ("int8", 32, 320), ("int4", 64, 64), ("int4g96", 16, 576), ("Q5_0", 32, 160),
         ("Q6_K", 16, 512)]  # fmt: skip


@pytest.mark.parametrize(("kind", "n", "k"), KINDS)
def test_tiles_round_trip_and_keep_fp16_scales_only_where_exact(kind: str, n: int, k: int) -> None:
    w = random_packed(kind, n, k, seed=n + k)
    t = tile_weight(w)
    plain = w.q if w.bits == 8 else unpack_u4(w.q)
    assert torch.equal(untile_codes(t, n, k), plain)
    # GGUF's and int4's scales are fp16 values; Q4_K's (fp16 x 6 bits) and int8's are not
    assert t.scale.dtype == (
        torch.float32 if kind in ("Q4_K", "int8", "Q6_K") else torch.float16
    )  # Q6_K: fp16 x int8
    assert torch.equal(t.scale.float().transpose(1, 2).reshape(n, -1), w.scale)
    last = n // 16 - 1  # the last tile
    if w.bits == 4:  # tile t, vector v, lane j, byte b: q[16t+j, 8v+b] | q[16t+j, 8v+4+b] << 4
        r = 16 * last + 5
        assert int(t.codes[last, 64 * 3 + 4 * 5 + 2]) == int(plain[r, 26]) | int(plain[r, 30]) << 4
    else:  # byte (v, j, b) = q[16t+j, 4v+b] + 128
        assert int(t.codes[last, 64 * 7 + 4 * 9 + 1]) == int(plain[16 * last + 9, 29]) + 128
    with pytest.raises(ValueError, match="16 x 32 tiles"):
        tile_weight(random_packed(kind, n - 1, k, seed=1))


@pytest.mark.parametrize(("kind", "n", "k"), KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_its_int8_activation_reference(
    kernels: Kernels, kind: str, n: int, k: int, dtype: torch.dtype
) -> None:
    w = random_packed(kind, n, k, seed=n + 2 * k)
    t = tile_weight(w)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    if not kernels.quant_gemv_ok(n, k, w.group, w.bits):  # no AVX512-VNNI: refused, never wrong
        with pytest.raises(RuntimeError, match="AVX512-VNNI"):
            kernels.quant_gemv(x, t.codes, t.scale, t.min, t.group, t.bits)
        return
    ref_w = dequantize_reference(w)
    xq = int8_activations(x)
    bound = (xq.abs() @ ref_w.abs().T) * (k * 2**-22)
    for m in (1, 3, 4, 5, 8, 17):
        got = kernels.quant_gemv(x[:m], t.codes, t.scale, t.min, t.group, t.bits)
        assert got.dtype == dtype and got.shape == (m, n)
        want = F.linear(xq[:m], ref_w)
        tol = bound[:m] + (want.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
        assert bool(((got.float() - want).abs() <= tol + 1e-30).all()), m
        one = kernels.quant_gemv(x[m - 1 : m], t.codes, t.scale, t.min, t.group, t.bits)
        assert torch.equal(got[-1:], one)  # a row's result never depends on its batch mates


def test_gemv_refuses_bad_shapes(kernels: Kernels) -> None:
    w = random_packed("Q4_1", 32, 128, seed=3)
    t = tile_weight(w)
    x = torch.randn(2, 128).to(torch.bfloat16)
    assert not kernels.quant_gemv_ok(40, 128, 32, 4)  # N % 16
    assert not kernels.quant_gemv_ok(32, 80, 32, 4)  # K % 32
    assert not kernels.quant_gemv_ok(32, 128, 48, 4)  # group % 32
    assert not kernels.quant_gemv_ok(32, 128, 16, 4)  # groups of 16: 8 bits only
    assert not kernels.quant_gemv_ok(32, 128, 48, 8)
    assert not kernels.quant_gemv_ok(32, 128, 32, 2)
    with pytest.raises(RuntimeError):
        kernels.quant_gemv(x[:, :96], t.codes, t.scale, t.min, t.group, t.bits)  # K
    with pytest.raises(RuntimeError):
        kernels.quant_gemv(x, t.codes, t.scale, None, t.group, t.bits)  # 4 bits need a min
    with pytest.raises(RuntimeError):
        kernels.quant_gemv(x, t.codes, t.scale.float(), t.min, t.group, t.bits)  # mixed types
    with pytest.raises(RuntimeError):
        kernels.quant_gemv(x.half(), t.codes, t.scale, t.min, t.group, t.bits)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "int8", "int4"])
def test_bf16_decode_rows_take_gemv_on_vnni(
    kernels: Kernels, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 decode rows: quant_gemv where the CPU has AVX512-VNNI (the AVX2 int8 kernel
    without AVX-512, PyTorch's ops otherwise); float32 always the exact quant_linear;
    ``GEMV = False`` restores the previous choice."""
    w = random_packed(kind, 32, 256, seed=11)
    lin = QuantLinear(w, torch.bfloat16, kernels)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    if kernels.quant_gemv_ok(32, 256, w.group, w.bits):
        assert lin.kernel == "quant_gemv" and lin.tiled is not None
        assert lin.decode_bytes < w.nbytes or kind == "int8"  # fp16 scales where exact
        t = lin.tiled
        assert torch.equal(lin(x), kernels.quant_gemv(x, t.codes, t.scale, t.min, 32 if
                                                      kind != "int8" else 256, w.bits))  # fmt: skip
        # up to GEMV_ROWS rows it runs too (it beat dequantize + oneDNN there); prefill
        # rows beyond multiply the same weights through dequantize + oneDNN
        assert lin.prefill_rows == quant_linear.GEMV_ROWS
        assert torch.equal(lin(torch.cat([x] * 40))[:3], lin(x))  # 120 rows: the kernel
        big = lin(torch.cat([x] * 48))
        torch.testing.assert_close(big[:3].float(), lin(x).float(), rtol=3e-2, atol=3e-2)
    else:
        assert lin.kernel != "quant_gemv"
    assert QuantLinear(w, torch.float32, kernels).kernel == "quant_linear"
    monkeypatch.setattr(quant_linear, "GEMV", False)
    assert QuantLinear(w, torch.bfloat16, kernels).kernel != "quant_gemv"
