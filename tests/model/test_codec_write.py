"""The C++ KV write of the per-token codecs (``codec_write``) stores exactly what the
codec's PyTorch ``write`` stores: the same codes and bf16 parameters, bit for bit, for
bf16 and float32 rows, strided rows (views into a fused qkv), outliers, all-zero rows,
rows near rounding ties, and any slot order; the C++ block gather (``codec_gather``)
returns exactly the codec's ``gather`` (kivi2's too, residual pool included); bad input is
refused, nothing written."""

from __future__ import annotations

import pytest
import torch

from kvstack.kv.codecs import CacheShape, KVCodec, codec_class
from kvstack.kv.codecs.rotated4 import hadamard, rotate_rows, unrotate_rows
from kvstack.model.kernels.loader import Kernels

CODECS = ["int8", "fp8", "fp8_e5m2", "int4", "rotated4"]


def _pair(name: str, dtype: torch.dtype, kvh: int, hd: int) -> tuple[KVCodec, KVCodec]:
    shape = CacheShape(1, 9, 16, kvh, hd)
    return codec_class(name)(shape, dtype, 4), codec_class(name)(shape, dtype, 4)


def _rows(g: torch.Generator, t: int, kvh: int, hd: int, dtype: torch.dtype):
    """k, v as views into one [t, (9 + 2 kvh) hd] qkv row block, as the model splits it."""
    qkv = torch.randn(t, (9 + 2 * kvh) * hd, generator=g) * 3
    qkv[:, 9 * hd + 5] += 40.0  # an outlier channel of the first KV head's keys
    qkv[0, 9 * hd : (9 + kvh) * hd] = 0.0  # an all-zero key row: scale clamps to 1e-12
    if t > 1:  # small integers in a value row: quotients near rounding ties
        qkv[1, (9 + kvh) * hd :] = torch.arange(kvh * hd) % 7 - 3.0
    qkv = qkv.to(dtype)
    k = qkv[:, 9 * hd : (9 + kvh) * hd].view(t, kvh, hd)
    v = qkv[:, (9 + kvh) * hd :].view(t, kvh, hd)
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("hd", [64, 128])
def test_codec_write_matches_the_pytorch_write(
    kernels: Kernels, name: str, dtype: torch.dtype, hd: int
) -> None:
    g = torch.Generator().manual_seed(hd)
    ref, cpp = _pair(name, dtype, 3, hd)
    view = cpp.per_token_view(0)
    assert view is not None
    for t in (37, 1, 5):  # a prefill chunk, a decode, a few rows; slots in any order
        k, v = _rows(g, t, 3, hd, dtype)
        slots = torch.randperm(9 * 16, generator=g)[:t]
        ref.write(0, slots, k, v)
        kernels.codec_write(
            view.layout, view.group, k, v, slots, view.k_codes, view.v_codes,
            view.k_params, view.v_params, view.rotation_signs,
        )  # fmt: skip
    for a, b in zip(ref.tensors(), cpp.tensors(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    cpp.check_integrity()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("hd", [64, 128])
def test_codec_gather_matches_the_pytorch_gather(
    kernels: Kernels, name: str, dtype: torch.dtype, hd: int
) -> None:
    g = torch.Generator().manual_seed(hd + 1)
    codec, _ = _pair(name, dtype, 3, hd)
    k, v = _rows(g, 9 * 16, 3, hd, dtype)
    codec.write(0, torch.randperm(9 * 16, generator=g), k, v)
    view = codec.per_token_view(0)
    assert view is not None
    for ids in (torch.tensor([3, 0, 8]), torch.tensor([[1, 2], [2, 7]]), torch.tensor([5])):
        want = codec.gather(0, ids)
        got = kernels.codec_gather(
            view.layout, view.group, view.k_codes, view.v_codes, view.k_params,
            view.v_params, view.rotation_signs, ids, hd, dtype,
        )  # fmt: skip
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape == (*ids.shape, 16, 3, hd)
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        kernels.codec_gather(
            view.layout, view.group, view.k_codes, view.v_codes, view.k_params,
            view.v_params, view.rotation_signs, torch.tensor([1, 9]), hd, dtype,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_codec_gather_matches_kivi2s_gather(kernels: Kernels, dtype: torch.dtype) -> None:
    """Full blocks from their 2-bit codes, filling blocks from the residual pool."""
    g = torch.Generator().manual_seed(7)
    codec = codec_class("kivi2")(CacheShape(1, 9, 16, 3, 64), dtype, 4)
    for slots in (torch.arange(0, 64), torch.arange(64, 69), torch.arange(96, 105)):
        k, v = _rows(g, slots.numel(), 3, 64, dtype)
        codec.write(0, slots, k, v)  # blocks 0-3 quantized; 4 and 6 filling
    view = codec.gather_view(0)
    assert view is not None and view.residual_of is not None
    assert (view.residual_of[[4, 6]] >= 0).all() and (view.residual_of[:4] < 0).all()
    for ids in (torch.tensor([4, 0, 6, 3]), torch.tensor([[1, 6], [2, 4]])):
        want = codec.gather(0, ids)
        got = kernels.codec_gather(
            "kivi2", view.group, view.k_codes, view.v_codes, view.k_params, view.v_params,
            None, ids, 64, dtype, view.res_k, view.res_v, view.residual_of,
        )  # fmt: skip
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape == (*ids.shape, 16, 3, 64)
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="residual pool must be"):
        kernels.codec_gather(
            "kivi2", view.group, view.k_codes, view.v_codes, view.k_params, view.v_params,
            None, ids, 64, dtype, view.res_k[:, :8], view.res_v, view.residual_of,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="only kivi2 has a residual pool"):
        kernels.codec_gather(
            "int8", 0, view.k_codes, view.v_codes, view.k_params, view.v_params,
            None, ids, 64, dtype, view.res_k, view.res_v, view.residual_of,
        )  # fmt: skip
    codec.check_integrity()


def test_rotate_rows_is_the_hadamard_rotation() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 64, generator=g)
    signs = torch.randint(0, 2, (64,), generator=g).float() * 2 - 1
    rot = signs[:, None] * hadamard(64)
    torch.testing.assert_close(rotate_rows(x, signs), x @ rot, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unrotate_rows(x, signs), x @ rot.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unrotate_rows(rotate_rows(x, signs), signs), x, rtol=1e-5, atol=1e-5)


def test_kivi_and_identity_codecs_keep_their_own_write() -> None:
    shape = CacheShape(1, 4, 16, 3, 64)
    for name in ("kivi2", "auto", "bf16"):
        assert codec_class(name)(shape, torch.float32, 2).per_token_view(0) is None


def test_codec_write_refuses_bad_input(kernels: Kernels) -> None:
    g = torch.Generator().manual_seed(0)
    codec, _ = _pair("int8", torch.bfloat16, 3, 64)
    view = codec.per_token_view(0)
    assert view is not None
    k, v = _rows(g, 4, 3, 64, torch.bfloat16)
    args = (view.k_codes, view.v_codes, view.k_params, view.v_params, None)
    before = [t.clone() for t in codec.tensors()]
    with pytest.raises(RuntimeError, match="KV slot 144 out of range"):
        kernels.codec_write("int8", 0, k, v, torch.tensor([0, 1, 2, 144]), *args)
    with pytest.raises(RuntimeError, match="one slot per row"):
        kernels.codec_write("int8", 0, k, v, torch.tensor([0, 1]), *args)
    with pytest.raises(RuntimeError, match="not a per-token codec"):
        kernels.codec_write("kivi2", 32, k, v, torch.arange(4), *args)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        kernels.codec_write("int8", 0, k, v.float(), torch.arange(4), *args)
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernels.codec_write("int4", 32, k, v, torch.arange(4), *args)
    for a, b in zip(before, codec.tensors(), strict=True):  # nothing written
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
