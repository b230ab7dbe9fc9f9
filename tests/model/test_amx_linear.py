"""The AMX bf16 linear (``csrc/amx_linear.cpp``, ``model/kernels/amx_linear.py``) against a float32
matmul of the same bf16 values: every row count a tile boundary can split (1, 15, 16, 17,
31, 32, 33, past the 256-row chunk), odd column-pair counts, row-strided inputs; the
packing round trip; ``Linear`` routing decode-sized inputs to it and long ones to oneDNN;
and a clear error for shapes or CPUs the kernel cannot take. On a CPU without AMX the
kernel reports itself unavailable and ``Linear`` keeps oneDNN: the tests check that
instead of skipping."""

from __future__ import annotations

import pytest
import torch

from kvstack.model.arch.layers import Linear
from kvstack.model.kernels import amx_linear, packed_linear
from kvstack.model.kernels.loader import Kernels
from linear_util import assert_rounded_once, reference


@pytest.fixture(scope="module")
def amx(kernels: Kernels) -> bool:
    return bool(kernels.amx_linear_available())


def test_pack_round_trip() -> None:
    w = torch.randn(48, 96).bfloat16()
    packed = amx_linear.pack_weight(w)
    assert packed.shape == (3, 3, 16, 16, 2)
    assert torch.equal(amx_linear.unpack_weight(packed), w)
    assert packed[1, 2, 5, 7, 1] == w[16 + 7, 64 + 2 * 5 + 1]  # the layout of the docstring
    assert not amx_linear.packable(torch.randn(48, 80).bfloat16())  # K % 32 != 0
    assert not amx_linear.packable(torch.randn(40, 96).bfloat16())  # N % 16 != 0


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 100, 300])
def test_kernel_matches_float32_matmul(kernels: Kernels, amx: bool, rows: int) -> None:
    torch.manual_seed(rows)
    n, k = 80, 96  # five 16-column blocks: two pairs and a lone block
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    if not amx:
        with pytest.raises(RuntimeError, match="AMX is not available"):
            kernels.amx_linear(x, amx_linear.pack_weight(w), n)
        return
    assert_rounded_once(kernels.amx_linear(x, amx_linear.pack_weight(w), n), reference(x, w))


def test_row_strided_input(kernels: Kernels, amx: bool) -> None:
    if not amx:
        assert amx_linear.amx_kernels() is None
        return
    w, wide = torch.randn(32, 64).bfloat16(), torch.randn(20, 160).bfloat16()
    x = wide[:, 32:96]  # rows 160 apart: the kernel reads x in place
    assert x.stride() == (160, 1)
    assert_rounded_once(kernels.amx_linear(x, amx_linear.pack_weight(w), 32), reference(x, w))


def test_bad_shapes_are_refused(kernels: Kernels, amx: bool) -> None:
    w = torch.randn(32, 64).bfloat16()
    packed = amx_linear.pack_weight(w)
    with pytest.raises(RuntimeError, match="amx_linear"):
        kernels.amx_linear(torch.randn(4, 64), packed, 32)  # float32 input
    with pytest.raises(RuntimeError, match="amx_linear"):
        kernels.amx_linear(torch.randn(4, 64).bfloat16(), packed, 48)  # wrong out_features


def test_linear_routes_by_shape(amx: bool) -> None:
    """Decode-sized inputs take the AMX kernel where it runs, long ones oneDNN unless the
    input is deep (a down projection); both give the once-rounded product."""
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    lin = Linear(w, torch.bfloat16)
    kern = packed_linear.tile_kernel()
    assert (lin.tiles is not None) == (kern is not None)
    assert (kern is not None and kern.name == "amx") == amx  # AMX first where it runs
    for rows in (3, 64, amx_linear.AMX_MAX_ROWS + 5):
        x = torch.randn(rows, 96).bfloat16()
        assert amx_linear.use_amx(x, 64) == (rows <= amx_linear.AMX_MAX_ROWS)
        assert_rounded_once(lin(x), reference(x, w.bfloat16()))
    rows = amx_linear.AMX_MAX_ROWS + 5
    wide = torch.empty(64, 96).bfloat16()
    assert not amx_linear.use_amx(wide, amx_linear.WIDE_OUT + 16)  # lm_head at 64 rows
    assert amx_linear.use_amx(wide[:8], amx_linear.WIDE_OUT + 16)  # but not at 8
    assert amx_linear.use_amx(torch.empty(rows, amx_linear.DEEP_IN).bfloat16(), 64)
    assert not amx_linear.use_amx(torch.empty(8, 96), 64)  # float32
    assert Linear(w, torch.float32).tiles is None  # float32 stays bit-comparable (F.linear)
