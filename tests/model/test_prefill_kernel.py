"""The C++ ``paged_attention`` for every row of a step (prefill chunks and decodes in one
call) against the PyTorch reference, and ``greedy_argmax`` against ``torch.argmax``."""

from __future__ import annotations

import pytest
import torch

from kvstack.model.attention import prefill_attention
from kvstack.model.kernels.loader import Kernels, load_kernels


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    k = load_kernels()
    assert k is not None, "the C++ kernels must build on the test machine"
    return k


def _cache(g: torch.Generator, dtype: torch.dtype, kvh: int, hd: int, nb: int = 160):
    kc = torch.randn(nb, 16, kvh, hd, generator=g).to(dtype)
    vc = torch.randn(nb, 16, kvh, hd, generator=g).to(dtype)
    return kc, vc


def _reference(q, kc, vc, table, kc_before: int, n: int) -> torch.Tensor:
    """Chunk of ``n`` queries after ``kc_before`` earlier KV tokens, as the PyTorch path
    computes it: gather the table's K/V, mask query j to keys 0 .. kc_before + j."""
    kvh, hd = kc.shape[2], kc.shape[3]
    keys = kc[table].reshape(-1, kvh, hd)[: kc_before + n]
    vals = vc[table].reshape(-1, kvh, hd)[: kc_before + n]
    mask = torch.arange(kc_before + n)[None, :] <= torch.arange(kc_before, kc_before + n)[:, None]
    return prefill_attention(q, keys, vals, mask, hd**-0.5)


@pytest.mark.parametrize(
    "dtype,hd,heads",
    [(torch.float32, 64, (9, 3)), (torch.bfloat16, 64, (9, 3)), (torch.float32, 32, (4, 2))],
)
def test_prefill_rows_match_reference(
    kernels: Kernels, dtype: torch.dtype, hd: int, heads: tuple[int, int]
) -> None:
    """Two decodes and three chunks in one call: fresh (odd length), continuing across a
    block boundary, and a long one past the 512-token partition."""
    g = torch.Generator().manual_seed(1)
    h, kvh = heads
    kc, vc = _cache(g, dtype, kvh, hd)
    perm = torch.randperm(kc.shape[0], generator=g)
    chunks = [(0, 37), (21, 11), (1290, 10)]  # (KV tokens before, chunk length)
    tables, offset = [], 0
    for before, n in [(0, 5), (0, 300), *chunks]:  # two decode tables first
        nb = -(-(before + n) // 16)
        tables.append(perm[offset : offset + nb])
        offset += nb
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    dec_lens = [5, 300]
    rows = 2 + sum(n for _, n in chunks)
    q = torch.randn(rows, h, hd, generator=g).to(dtype)
    index = [0, 1] + [2 + i for i, (_, n) in enumerate(chunks) for _ in range(n)]
    lens = dec_lens + [b + j + 1 for b, n in chunks for j in range(n)]
    out = kernels.paged_attention(
        q, kc, vc, padded, torch.tensor(index), torch.tensor(lens), hd**-0.5
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    r = 0
    for i, ln in enumerate(dec_lens):
        ref = _reference(q[r : r + 1], kc, vc, tables[i], ln - 1, 1)
        assert (out[r : r + 1].float() - ref.float()).abs().max() < tol
        r += 1
    for i, (before, n) in enumerate(chunks):
        ref = _reference(q[r : r + n], kc, vc, tables[2 + i], before, n)
        assert (out[r : r + n].float() - ref.float()).abs().max() < tol
        r += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_row_is_scored_exactly_as_a_decode_of_its_position(
    kernels: Kernels, dtype: torch.dtype
) -> None:
    """Row j of any chunk gives the bit-identical output of a decode at that position,
    whatever the chunking: the invariant behind chunked = prefix-hit = fresh prefill."""
    g = torch.Generator().manual_seed(2)
    kc, vc = _cache(g, dtype, 3, 64)
    table = torch.randperm(kc.shape[0], generator=g)[:45][None]  # 720 tokens
    q = torch.randn(700, 9, 64, generator=g).to(dtype)
    whole = kernels.paged_attention(
        q, kc, vc, table, torch.zeros(700, dtype=torch.long), torch.arange(1, 701), 0.125
    )
    for start, n in [(0, 1), (13, 50), (511, 3), (600, 100)]:
        part = kernels.paged_attention(
            q[start : start + n], kc, vc, table, torch.zeros(n, dtype=torch.long),
            torch.arange(start + 1, start + n + 1), 0.125,
        )  # fmt: skip
        assert torch.equal(part, whole[start : start + n])
    dec = kernels.paged_decode_attention(q[599:600], kc, vc, table, torch.tensor([600]), 0.125)
    assert torch.equal(dec, whole[599:600])


def test_paged_attention_refuses_bad_indices(kernels: Kernels) -> None:
    kc = torch.zeros(4, 16, 3, 64)
    q = torch.zeros(2, 9, 64)
    table = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="table index 1 outside"):
        kernels.paged_attention(q, kc, kc, table, torch.tensor([0, 1]), torch.tensor([3, 4]), 0.1)
    with pytest.raises(RuntimeError, match="one table index per row"):
        kernels.paged_attention(q, kc, kc, table, torch.tensor([0]), torch.tensor([3, 4]), 0.1)
    with pytest.raises(RuntimeError, match="context length 33 outside"):
        kernels.paged_attention(q, kc, kc, table, torch.tensor([0, 0]), torch.tensor([3, 33]), 0.1)
    with pytest.raises(RuntimeError, match="block id 7 outside"):
        kernels.paged_attention(
            q, kc, kc, torch.tensor([[0, 7]]), torch.tensor([0, 0]), torch.tensor([3, 20]), 0.1
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_matches_torch(kernels: Kernels, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 1001, generator=g).to(dtype)  # 1001: a tail past the 16-lane loop
    x[1, [5, 900]] = 50.0  # a tie: the first index wins, as torch.argmax
    x[2, 1000] = 60.0  # maximum in the scalar tail
    x[3, :500] = float("-inf")  # some -inf is fine
    got = kernels.greedy_argmax(x)
    assert torch.equal(got, x.float().argmax(dim=-1))
    assert int(got[1]) == 5


def test_greedy_argmax_flags_rows_that_need_sanitizing(kernels: Kernels) -> None:
    x = torch.randn(4, 40)
    x[0, 3] = float("nan")
    x[1, 39] = float("inf")
    x[2] = float("-inf")
    assert kernels.greedy_argmax(x).tolist()[:3] == [-1, -1, -1]
    assert int(kernels.greedy_argmax(x)[3]) == int(x[3].argmax())
