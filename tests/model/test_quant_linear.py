"""Weight-only quantized linears (``model/quant/``, ``csrc/quant_linear.cpp``) against their
references: GGUF blocks decoded bit-identically to gguf-py's dequantization, the kernel
against dequantize-then-matmul on odd shapes, M = 1..40, bf16 and fp32 activations, rows
independent of their batch mates, and the int8 / int4 quantizers' error bounds."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvstack.model.kernels.loader import Kernels
from kvstack.model.quant.gguf_blocks import PACKED_GGUF_TYPES, pack_gguf
from kvstack.model.quant.linear import (
    QuantLinear,
    StackedLinear,
    int8_dot_is_avx2,
    torch_weight_op,
)
from kvstack.model.quant.packed import (
    PackedWeight,
    concat_rows,
    dequantize_reference,
    pack_u4,
    unpack_u4,
)
from kvstack.model.quant.quantize import quantize_int4, quantize_int8
from kvstack.model.quant.schemes import LinearBuilder
from kvstack.testing.tiny_models import quantize_q4_k
from quant_types_util import int8_activations

Q = gguf.GGMLQuantizationType
DTYPES = [torch.float32, torch.bfloat16]


def gguf_bytes(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """A random ``[n, k]`` tensor's GGUF bytes: gguf-py's quantizer, or kvstack's Q4_K one;
    Q4_K also gets fully random bytes (every scale / min bit pattern) for half the rows."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    if qtype == Q.Q6_K:  # no quantizer in gguf-py: random bytes, sane d (every code, sc)
        blocks = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
        d = (rng.uniform(0.5, 2, size=(n, k // 256)) / (32 * 64 * np.sqrt(k))).astype(np.float16)
        blocks[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
        return blocks.reshape(n, -1)
    if qtype != Q.Q4_K:
        return np.asarray(gguf.quants.quantize(w, qtype))
    raw = quantize_q4_k(w)
    noise = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)
    blocks = noise.reshape(n, -1, 144)
    blocks[..., 0:4] = np.array([0.01, 0.004], dtype=np.float16).view(np.uint8)  # d, dmin
    raw[n // 2 :] = blocks.reshape(n, -1)[n // 2 :]
    return raw


@pytest.mark.parametrize("qtype", list(PACKED_GGUF_TYPES))
def test_gguf_blocks_decode_exactly_as_gguf_py(qtype: Q) -> None:
    n, k = 7, 512
    raw = gguf_bytes(qtype, n, k, seed=int(qtype))
    packed = pack_gguf(raw, int(qtype))
    assert packed is not None and packed.source == qtype.name
    want = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(n, k)
    assert torch.equal(dequantize_reference(packed), torch.from_numpy(want))


def test_types_without_a_packed_kernel_are_left_to_the_dequantizer() -> None:
    raw = np.asarray(gguf.quants.quantize(np.ones((2, 64), np.float32), Q.Q5_1))
    assert pack_gguf(raw, int(Q.Q5_1)) is None
    assert pack_gguf(np.zeros((2, 176), np.uint8), int(Q.Q5_K)) is None


def test_nibble_order_round_trips() -> None:
    v = torch.randint(0, 16, (3, 96), dtype=torch.uint8)
    q = pack_u4(v)
    assert q.shape == (3, 48)
    assert int(q[0, 0]) == int(v[0, 0]) | int(v[0, 16]) << 4  # llama.cpp's block_q4_1 order
    assert torch.equal(unpack_u4(q), v)


def random_packed(kind: str, n: int, k: int, seed: int) -> PackedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    if kind == "int8":
        return quantize_int8(w)
    if kind == "int4":
        return quantize_int4(w)
    if kind == "int4g96":  # groups that are not chunk pairs: a pair may straddle two groups
        return quantize_int4(w, group=96)
    qtype = Q[kind]
    packed = pack_gguf(gguf_bytes(qtype, n, k, seed), int(qtype))
    assert packed is not None
    return packed


SHAPES = [  # (kind, N, K): odd N everywhere, int8 per channel also odd K
    ("int8", 7, 37),
    ("int8", 33, 600),
    ("int4", 5, 96),
    ("int4", 97, 160),
    ("Q8_0", 11, 96),
    ("Q4_0", 13, 224),
    ("Q4_1", 31, 576),
    ("Q4_K", 9, 512),
    ("Q5_0", 19, 160),
    ("Q6_K", 11, 512),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "n", "k"), SHAPES)
def test_kernel_matches_dequantize_then_matmul(
    kernels: Kernels, kind: str, n: int, k: int, dtype: torch.dtype
) -> None:
    w = random_packed(kind, n, k, seed=n * k)
    ref_w = dequantize_reference(w, dtype).float()  # bf16 activations: bf16-rounded weights
    assert torch.equal(
        kernels.quant_dequant(w.q, w.scale, w.min, w.group, w.bits, dtype),
        dequantize_reference(w, dtype),
    )
    g = torch.Generator().manual_seed(k)
    x = torch.randn(40, k, generator=g).to(dtype)
    # float32 sums in another order: bounded by K eps sum|x w| (+ the output's rounding)
    bound = (x.float().abs() @ ref_w.abs().T) * (k * 2**-23)
    for m in (1, 2, 3, 5, 8, 9, 16, 17, 32, 40):
        got = kernels.quant_linear(x[:m], w.q, w.scale, w.min, w.group, w.bits)
        assert got.dtype == dtype and got.shape == (m, n)
        want = F.linear(x[:m].float(), ref_w)
        tol = bound[:m] + (want.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
        assert bool(((got.float() - want).abs() <= tol + 1e-30).all()), (kind, m)
        # a row's result never depends on its batch mates (tiles of 8 rows or fewer)
        assert torch.equal(
            got[-1:], kernels.quant_linear(x[m - 1 : m], w.q, w.scale, w.min, w.group, w.bits)
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_path_multiplies_the_same_weights(kernels: Kernels, dtype: torch.dtype) -> None:
    w = random_packed("Q4_1", 64, 256, seed=5)
    lin = QuantLinear(w, dtype, kernels, prefill_rows=16, int8_activations=False)
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    big, small = lin(x), lin(x[:4])  # dequantize + oneDNN, then the kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(big[:4].float(), small.float(), rtol=tol, atol=tol)
    assert lin.kernel == ("quant_linear" if dtype == torch.float32 else "torch_int4pack")
    fast = QuantLinear(w, dtype, kernels, int8_activations=True)
    bf16 = dtype == torch.bfloat16 and kernels.quant_linear_vnni_ok(256, 32, 4)
    # never for fp32; in bf16 on a CPU with AVX-512 but no VNNI PyTorch's int4 op, as
    # without int8_activations (AVX2-only CPUs have the AVX2 build of the int8 kernel);
    # with AVX512-VNNI the tiled kernel (test_quant_gemv.py)
    plain = "torch_int4pack" if dtype == torch.bfloat16 else "quant_linear"
    gemv = bf16 and kernels.quant_gemv_ok(64, 256, 32, 4)
    assert fast.kernel == ("quant_gemv" if gemv else "quant_linear_vnni" if bf16 else plain)


def test_quantizers_stay_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 128, generator=g)
    w[1] = 0.25  # a constant row: int8 scale from |w|, int4 groups with scale 0
    w8 = quantize_int8(w)
    err8 = (dequantize_reference(w8) - w).abs()
    assert bool((err8 <= w8.scale / 2 + 1e-7).all())
    w4 = quantize_int4(w)
    assert w4.group == 32 and torch.equal(w4.scale, w4.scale.half().float())  # fp16 scales
    err4 = (dequantize_reference(w4) - w).abs().reshape(6, 4, 32)
    assert w4.min is not None
    step = (w4.scale / 2 + w4.min.abs() * 2**-10 + 1e-6).unsqueeze(-1)
    assert bool((err4 <= step).all())
    assert torch.equal(dequantize_reference(w4)[1], w[1])
    with pytest.raises(ValueError, match="divisible by the group"):
        quantize_int4(torch.ones(2, 48))


def test_fused_parts_of_one_width_concatenate_exactly() -> None:
    a, b = random_packed("Q4_1", 4, 64, 1), random_packed("Q4_1", 2, 64, 2)
    both = concat_rows([a, b])
    assert both is not None
    assert torch.equal(
        dequantize_reference(both), torch.cat([dequantize_reference(a), dequantize_reference(b)])
    )
    q4_0 = concat_rows([a, random_packed("Q4_0", 2, 64, 3)])
    assert q4_0 is not None and q4_0.source == "Q4_1+Q4_0"
    # 8 bits: Q5_0 q/k with a Q8_0 v (group 32), with a Q6_K v (group 16: scales repeated)
    q, v8, v6 = (random_packed(t, n, 256, s) for t, n, s in (("Q5_0", 6, 4), ("Q8_0", 2, 5),
                                                              ("Q6_K", 2, 6)))  # fmt: skip
    for v, group in ((v8, 32), (v6, 16)):
        fused = concat_rows([q, q, v])
        assert fused is not None and fused.group == group and fused.bits == 8
        assert fused.source == f"Q5_0+{v.source}"
        want = torch.cat([dequantize_reference(p) for p in (q, q, v)])
        assert torch.equal(dequantize_reference(fused), want)
    assert concat_rows([random_packed("Q4_K", 2, 256, 7), v6]) is None  # 4 with 8 bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_4_and_8_bit_parts_stay_packed_side_by_side(
    kernels: Kernels, dtype: torch.dtype
) -> None:
    """Q4_K q/k with a Q6_K v (the 1.5B's layers): two packed linears, outputs joined --
    never a dense fallback -- and exactly the one-format kernels' results."""
    parts = {"q": random_packed("Q4_K", 32, 512, 1), "k": random_packed("Q4_K", 16, 512, 2),
             "v": random_packed("Q6_K", 16, 512, 3)}  # fmt: skip
    builder = LinearBuilder("gguf", dtype, parts, kernels)
    lin = builder.build(["q", "k", "v"], {n: torch.empty(0) for n in parts})
    assert isinstance(lin, StackedLinear) and lin.out_features == 64 and lin.in_features == 512
    assert [p.packed.source for p in lin.parts] == ["Q4_K", "Q6_K"]
    assert "dense" not in builder.summary()
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    qk, v = lin.parts
    assert torch.equal(lin(x), torch.cat([qk(x), v(x)], dim=1))
    want = torch.cat([dequantize_reference(parts[n], dtype) for n in "qkv"])
    assert torch.equal(lin.dequantize(dtype), want)
    assert lin.decode_bytes == qk.decode_bytes + v.decode_bytes


def test_packed_parts_stay_packed_beside_a_part_without_a_kernel(kernels: Kernels) -> None:
    """A v of a GGUF type with no packed kernel (e.g. Q5_K) is dense alone; q/k keep
    their packed bytes (before, the whole fused matrix was dequantized)."""
    q = random_packed("Q4_K", 32, 256, 1)
    v = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    builder = LinearBuilder("gguf", torch.float32, {"q": q}, kernels)
    lin = builder.build(["q", "v"], {"q": torch.empty(0), "v": v})
    assert isinstance(lin, StackedLinear) and lin.kernel == "quant_linear + dense"
    assert builder.summary() == "1 x Q4_K 4-bit -> quant_linear, 1 x dense float32 (not packed)"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    want = F.linear(x, torch.cat([dequantize_reference(q), v]))
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.dequantize(torch.float32), torch.cat([dequantize_reference(q), v]))


@pytest.mark.parametrize(("kind", "n", "k"), [("Q4_1", 31, 576), ("Q4_0", 7, 128),
                                              ("Q8_0", 9, 192), ("Q4_K", 5, 512),
                                              ("int8", 17, 320), ("int4", 3, 64),
                                              ("int4g96", 5, 576), ("Q5_0", 7, 192),
                                              ("Q6_K", 5, 512)])  # fmt: skip
def test_vnni_kernel_matches_its_int8_activation_reference(
    kernels: Kernels, kind: str, n: int, k: int
) -> None:
    w = random_packed(kind, n, k, seed=n + k)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    if not kernels.quant_linear_vnni_ok(k, 32, 8):  # no AVX512-VNNI: refused, never wrong
        with pytest.raises(RuntimeError, match="AVX512-VNNI"):
            kernels.quant_linear_vnni(x, w.q, w.scale, w.min, w.group, w.bits)
        return
    assert kernels.quant_linear_vnni_ok(w.in_features, w.group, w.bits)
    ref_w = dequantize_reference(w)
    xq = int8_activations(x)
    bound = (xq.abs() @ ref_w.abs().T) * (k * 2**-22)
    for m in (1, 3, 4, 5, 11):
        got = kernels.quant_linear_vnni(x[:m], w.q, w.scale, w.min, w.group, w.bits)
        want = F.linear(xq[:m], ref_w)
        assert bool(((got.float() - want).abs() <= bound[:m] + want.abs() * 2**-8).all()), m
        one = kernels.quant_linear_vnni(x[m - 1 : m], w.q, w.scale, w.min, w.group, w.bits)
        assert torch.equal(got[-1:], one)
    assert not kernels.quant_linear_vnni_ok(96, 32, 4)  # K % 64: the float kernel's case


@pytest.mark.parametrize(("kind", "n", "k"), [("int8", 32, 64), ("int4", 64, 192),
                                              ("Q4_1", 96, 576), ("Q4_K", 32, 512)])  # fmt: skip
def test_torch_weight_ops_match_the_reference_within_bf16_scales(kind: str, n: int, k: int) -> None:
    """gpt-fast's ops (bf16 activations): bf16 scales and zeros, so within 2^-8 of
    sum |x w| of the exact product; never chosen for float32."""
    assert torch_weight_op(random_packed(kind, n - 1, k, seed=1), torch.bfloat16) is None
    w = random_packed(kind, n, k, seed=3 * n)
    op = torch_weight_op(w, torch.bfloat16)
    assert op is not None and torch_weight_op(w, torch.float32) is None
    assert op.name == ("torch_int8pack" if kind == "int8" else "torch_int4pack")
    ref_w = dequantize_reference(w)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    want = F.linear(x.float(), ref_w)
    got = op(x)
    assert got.dtype == torch.bfloat16 and got.shape == (9, n)
    bound = (x.float().abs() @ ref_w.abs().T) * 2**-7 + want.abs() * 2**-8
    assert bool(((got.float() - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_q8_0_decodes_on_the_vnni_kernel_in_bf16(kernels: Kernels, dtype: torch.dtype) -> None:
    """Q8_0 (the default model's lm_head) has no PyTorch op: in bf16 on a VNNI CPU its
    decode rows take quant_linear_vnni (llama.cpp's int8 activations), float32 keeps the
    exact quant_linear; prefill rows multiply the same weights either way."""
    w = random_packed("Q8_0", 64, 192, seed=4)
    lin = QuantLinear(w, dtype, kernels, int8_activations=False)
    vnni = dtype == torch.bfloat16 and kernels.quant_linear_vnni_ok(192, 32, 8)
    assert lin.kernel == ("quant_linear_vnni" if vnni else "quant_linear")
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = kernels.quant_linear_vnni if vnni else kernels.quant_linear
    assert torch.equal(lin(x), ref(x, w.q, w.scale, w.min, w.group, w.bits))


def test_int8_per_channel_decodes_on_the_vnni_kernel_in_bf16(kernels: Kernels) -> None:
    """int8 per channel has PyTorch's op, but VNNI reads the lm_head-sized weights ~2x
    faster: bf16 decode rows take it where the CPU has it."""
    w = random_packed("int8", 64, 192, seed=6)
    vnni = kernels.quant_linear_vnni_ok(192, w.group, 8)
    lin = QuantLinear(w, torch.bfloat16, kernels, int8_activations=False)
    assert lin.kernel == ("quant_linear_vnni" if vnni else "torch_int8pack")


def test_4bit_bf16_decode_takes_the_int8_dot_only_on_avx2(kernels: Kernels) -> None:
    """Without AVX-512 (PyTorch's capability AVX2) the AVX2 int8 kernel beat PyTorch's
    int4 op at every decode M, so it is the default there; with AVX512-VNNI the tiled
    kernel (test_quant_gemv.py); elsewhere PyTorch's op stays."""
    w = random_packed("Q4_1", 64, 256, seed=7)
    lin = QuantLinear(w, torch.bfloat16, kernels)
    avx2 = int8_dot_is_avx2() and kernels.quant_linear_vnni_ok(256, 32, 4)
    gemv = kernels.quant_gemv_ok(64, 256, 32, 4)
    want = "quant_linear_vnni" if avx2 else "quant_gemv" if gemv else "torch_int4pack"
    assert lin.kernel == want
    assert QuantLinear(w, torch.float32, kernels).kernel == "quant_linear"
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ref = F.linear(x.float(), dequantize_reference(w))
    bound = (x.float().abs() @ dequantize_reference(w).abs().T) * 2**-6 + ref.abs() * 2**-7
    assert bool(((lin(x).float() - ref).abs() <= bound).all())
