"""The bf16 linear (``csrc/bf16_linear.cpp``: AVX512-BF16, AVX-512F over ``fma512_bf16.h``
or AVX2 + FMA over ``fma_bf16.h``; the tests run whichever this CPU builds), the kernel choice
(``model/kernels/packed_linear.py``) and huge-page memory (``kvstack/core/hugepages.py``).

The kernel against a float32 matmul of the same bf16 values: every row count its 6-row
blocks and 96-row chunks can split, every column-group remainder (1-4 blocks of 16 per
thread), row-strided inputs, the prefetch of the next group crossing the end of a thread's
range. On a CPU with neither the kernel says so with a clear error, and the tests check
that instead of skipping."""

from __future__ import annotations

import itertools
import mmap
import threading

import pytest
import torch

from kvstack.core import hugepages
from kvstack.model.arch.layers import Linear
from kvstack.model.kernels import amx_linear, packed_linear
from kvstack.model.kernels.loader import Kernels, fallback_counts
from linear_util import assert_rounded_once, reference


@pytest.fixture(scope="module")
def avx512(kernels: Kernels) -> bool:
    return bool(kernels.bf16_linear_available())


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 32, 95, 96, 97, 200, 256, 389, 800])
@pytest.mark.parametrize("n", [16, 48, 80, 144])  # 1, 3, 5, 9 column blocks
def test_kernel_matches_float32_matmul(kernels: Kernels, avx512: bool, rows: int, n: int) -> None:
    torch.manual_seed(rows * 1000 + n)
    k = 96
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    packed = amx_linear.pack_weight(w)
    if not avx512:
        with pytest.raises(RuntimeError, match="nor AVX2\\+FMA is available"):
            kernels.bf16_linear(x, packed, n)
        return
    assert_rounded_once(kernels.bf16_linear(x, packed, n), reference(x, w))


def test_one_thread_and_deep_input(kernels: Kernels, avx512: bool) -> None:
    """One thread takes every column group in turn (the prefetch runs past each group);
    a deep K (a down projection) accumulates over 768 pairs, in 96-row (AVX512) or 40-row
    (AVX2: 256 KiB of float32 x) chunks."""
    if not avx512:
        return
    torch.manual_seed(1)
    w, x = torch.randn(112, 1536).bfloat16(), torch.randn(97, 1536).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y = kernels.bf16_linear(x, amx_linear.pack_weight(w), 112)
    finally:
        torch.set_num_threads(threads)
    assert_rounded_once(y, reference(x, w))


def test_row_strided_input_and_empty(kernels: Kernels, avx512: bool) -> None:
    if not avx512:
        return
    w, wide = torch.randn(32, 64).bfloat16(), torch.randn(20, 160).bfloat16()
    x = wide[:, 32:96]  # rows 160 apart: the kernel reads x in place
    assert x.stride() == (160, 1)
    assert_rounded_once(kernels.bf16_linear(x, amx_linear.pack_weight(w), 32), reference(x, w))
    assert kernels.bf16_linear(x[:0], amx_linear.pack_weight(w), 32).shape == (0, 32)


def test_bad_shapes_are_refused(kernels: Kernels) -> None:
    packed = amx_linear.pack_weight(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bf16_linear"):
        kernels.bf16_linear(torch.randn(4, 64), packed, 32)  # float32 input
    with pytest.raises(RuntimeError, match="bf16_linear"):
        kernels.bf16_linear(torch.randn(4, 64).bfloat16(), packed, 48)  # wrong out_features
    with pytest.raises(RuntimeError, match="bf16_linear"):
        kernels.bf16_linear(torch.randn(4, 64).bfloat16()[:, ::2], packed, 32)  # strided


def test_kernel_choice_and_routing(avx512: bool, kernels: Kernels) -> None:
    """AMX first, then AVX512-BF16, which takes every bf16 input (batch invariant); float32
    goes to F.linear; all giving the once-rounded product."""
    kern = packed_linear.tile_kernel()
    amx = bool(kernels.amx_linear_available())
    isa = str(kernels.bf16_linear_isa())
    expected = "amx" if amx else isa if isa == "avx512_bf16" else None
    if not amx and isa in ("avx512_fma", "avx2_fma") and not packed_linear.onednn_bf16():
        expected = isa  # AVX-512F without BF16, or AVX2 only: oneDNN has no native bf16
    assert (kern.name if kern else None) == expected
    if kern is not None:
        assert kern.batch_invariant == (kern.name in ("avx512_bf16", "avx512_fma"))
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    lin = Linear(w, torch.bfloat16)
    assert (lin.tiles is not None) == (expected is not None)
    for rows in (1, 64, 192, 193, 300):
        x = torch.randn(rows, 96).bfloat16()
        assert packed_linear.use_every(x, 64)
        assert packed_linear.use_every(x, packed_linear.WIDE_OUT + 16)  # lm_head
        assert_rounded_once(lin(x), reference(x, w.bfloat16()))
    assert not packed_linear.use_every(torch.randn(8, 96), 64)  # float32
    assert not packed_linear.use_every(torch.randn(8, 192).bfloat16()[:, ::2], 64)
    assert Linear(w, torch.float32).tiles is None


def test_rows_do_not_depend_on_their_batch_mates(kernels: Kernels, avx512: bool) -> None:
    """Batch invariance: every row of an M-row input equals that row computed alone, bit
    for bit, for M across the kernel's row blocks and chunks and past its row split (256
    rows on AVX512-BF16), for a layer as wide as an lm_head too; where the chosen kernel
    takes every input (``TileKernel.batch_invariant``), ``Linear`` returns the same."""
    torch.manual_seed(3)
    x = torch.randn(400, 576).bfloat16()
    if not avx512:
        with pytest.raises(RuntimeError, match="nor AVX2\\+FMA is available"):
            kernels.bf16_linear(x, amx_linear.pack_weight(torch.randn(96, 576).bfloat16()), 96)
        return
    kern = packed_linear.tile_kernel()
    picked = torch.arange(0, 400, 37)
    for n in (96, packed_linear.WIDE_OUT + 16):
        w = torch.randn(n, 576).bfloat16()
        packed = amx_linear.pack_weight(w)
        alone = torch.cat([kernels.bf16_linear(x[i : i + 1], packed, n) for i in picked])
        lin = Linear(w, torch.bfloat16)
        for rows in (1, 7, 65, 97, 193, 256, 400):
            got = kernels.bf16_linear(x[:rows], packed, n)
            some = picked[picked < rows]
            assert torch.equal(got[some], alone[: len(some)]), (n, rows)
            if kern is not None and kern.batch_invariant:
                assert torch.equal(lin(x[:rows]), got), (n, rows)


def test_avx2_routing_and_widened_path() -> None:
    """The AVX2 + FMA rule: up to AVX2_MAX_ROWS rows, and the lm_head at any size; the rest
    runs ``widened_linear`` (float32 GEMM of widened copies), also rounded once."""
    avx2_max = packed_linear.AVX2_MAX_ROWS
    narrow = torch.empty(avx2_max + 1, 96).bfloat16()
    assert packed_linear.use_avx2(narrow[:-1], 64)
    assert not packed_linear.use_avx2(narrow, 64)
    assert packed_linear.use_avx2(narrow, packed_linear.WIDE_OUT + 16)  # lm_head
    assert not packed_linear.use_avx2(torch.randn(8, 96), 64)  # float32
    assert not packed_linear.use_avx2(torch.randn(8, 192).bfloat16()[:, ::2], 64)
    torch.manual_seed(2)
    w, x = torch.randn(48, 96).bfloat16(), torch.randn(300, 96).bfloat16()
    assert_rounded_once(packed_linear.widened_linear(x, w), reference(x, w))


def test_huge_page_arena_layout() -> None:
    """Tensors are 64-byte aligned, never overlap, big ones get a chunk of their own, and
    the values survive (the chunk's storage lives while any tensor cut from it does)."""
    arena = hugepages.HugeArena(chunk_bytes=1 << 20)
    small = [arena.copy(torch.full((100,), float(i))) for i in range(40)]  # 400 B each
    big = arena.copy(torch.arange(100_000, dtype=torch.float32))  # > chunk / 4
    assert arena.chunks == [1 << 20, 400_000]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in small)
    assert all(a % hugepages.ALIGN == 0 for a, _ in spans)
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
    del arena
    assert all(float(t[7]) == i for i, t in enumerate(small))
    assert torch.equal(big, torch.arange(100_000, dtype=torch.float32))
    z = hugepages.zeros((3, 5, 7), torch.bfloat16)
    assert z.shape == (3, 5, 7) and z.is_contiguous() and not bool(z.any())


def test_huge_pages_are_advised_or_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel has transparent huge pages the advice is given; where it says
    ``never`` the memory is ordinary pages and the fallback is counted, not silent."""
    before = fallback_counts().get(("hugepages", "thp_never"), 0)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    t = hugepages.zeros((1024,), torch.float32)
    assert fallback_counts()[("hugepages", "thp_never")] == before + 1
    assert not bool(t.any())
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    hugepages.zeros((16,), torch.float32)
    assert fallback_counts()[("hugepages", "no_madvise")] >= 1


def test_huge_page_arena_is_thread_safe() -> None:
    """Two threads cutting tensors from one arena never get overlapping ranges."""
    arena = hugepages.HugeArena(chunk_bytes=1 << 16)
    got: list[torch.Tensor] = []

    def cut() -> None:
        for _ in range(300):
            got.append(arena.empty((37,), torch.float32))

    threads = [threading.Thread(target=cut) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted((t.data_ptr(), t.data_ptr() + 37 * 4) for t in got)
    assert len(spans) == 600
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
