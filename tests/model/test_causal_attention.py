"""The AVX512-BF16 causal prefill attention (``csrc/prefill_attention.cpp``) against a
float32 SDPA of the same bf16 values, and its routing in ``model/attention.py``.

Cases: one token; lengths that split its 32-row tiles and 16-key blocks unevenly; keys
before the queries (a chunk after its context); several equal prompts in one call; GQA
ratios 1-9; head_dim 32, 64, 256 (Gemma 3); row-strided q/k/v (views of the fused qkv
output, as the model passes them). On a CPU without AVX512-BF16 the kernel says so and the
routing keeps SDPA: the tests check that instead of skipping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstack.model import attention
from kvstack.model.kernels.loader import Kernels


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: int) -> torch.Tensor:
    lq, lk = q.shape[0] // seqs, k.shape[0] // seqs
    qq, kk, vv = (t.float().unflatten(0, (seqs, -1)).transpose(1, 2) for t in (q, k, v))
    mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    out = F.scaled_dot_product_attention(
        qq, kk, vv, attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True
    )
    return out.transpose(1, 2).flatten(0, 1)


def assert_close_to_rounded(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a few bf16 ulps of the float32 result (the weights are rounded to bf16 for
    the P V product, as PyTorch's bf16 flash attention rounds them)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    tol = 4 * torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(0.25)
    assert bool(((out.float() - ref).abs() <= tol).all())


@pytest.fixture(scope="module")
def avx512(kernels: Kernels) -> bool:
    return bool(kernels.causal_attention_available())


CASES = [  # seqs, q_len, k_len, heads, kv_heads, head_dim
    (1, 1, 1, 2, 1, 32),
    (3, 17, 17, 9, 3, 64),
    (2, 40, 75, 4, 2, 64),
    (1, 33, 100, 8, 8, 64),
    (4, 65, 65, 9, 1, 64),
    (1, 31, 31, 8, 1, 256),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_float32_sdpa(kernels: Kernels, avx512: bool, case: tuple[int, ...]) -> None:
    seqs, lq, lk, h, kvh, hd = case
    g = torch.Generator().manual_seed(sum(case))
    q = torch.randn(seqs * lq, h, hd, generator=g).bfloat16()
    k = torch.randn(seqs * lk, kvh, hd, generator=g).bfloat16()
    v = torch.randn(seqs * lk, kvh, hd, generator=g).bfloat16()
    if not avx512:
        with pytest.raises(RuntimeError, match="AVX512-BF16 is not available"):
            kernels.causal_attention(q, k, v, seqs, hd**-0.5)
        return
    out = kernels.causal_attention(q, k, v, seqs, hd**-0.5)
    assert_close_to_rounded(out, reference(q, k, v, seqs))


def test_strided_views_of_fused_qkv(kernels: Kernels, avx512: bool) -> None:
    if not avx512:
        return
    h, kvh, hd, n = 9, 3, 64, 50
    qkv = torch.randn(n, (h + 2 * kvh) * hd).bfloat16()
    q = qkv[:, : h * hd].view(n, h, hd)
    k = qkv[:, h * hd : (h + kvh) * hd].view(n, kvh, hd)
    v = qkv[:, (h + kvh) * hd :].view(n, kvh, hd)
    assert q.stride(0) == (h + 2 * kvh) * hd
    assert_close_to_rounded(kernels.causal_attention(q, k, v, 1, hd**-0.5), reference(q, k, v, 1))


@pytest.mark.parametrize("rows", [[0], [3, 4, 40, 41, 70, 99], list(range(5, 100, 2))])
def test_sparse_rows_at_their_positions(kernels: Kernels, avx512: bool, rows: list[int]) -> None:
    """Segment reuse's repair rows: row i at ``positions[i]`` attends keys 0 ..
    positions[i] (tiles of 32 rows whose positions spread over the keys; one row)."""
    if not avx512:
        return
    g = torch.Generator().manual_seed(len(rows))
    lk, h, kvh, hd = 100, 9, 3, 64
    q = torch.randn(len(rows), h, hd, generator=g).bfloat16()
    k = torch.randn(lk, kvh, hd, generator=g).bfloat16()
    v = torch.randn(lk, kvh, hd, generator=g).bfloat16()
    pos = torch.tensor(rows)
    out = kernels.causal_attention(q, k, v, 1, hd**-0.5, pos)
    qq, kk, vv = (t.float().transpose(0, 1) for t in (q, k, v))
    mask = torch.arange(lk)[None, :] <= pos[:, None]
    ref = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=hd**-0.5,
                                         enable_gqa=True).transpose(0, 1)  # fmt: skip
    assert_close_to_rounded(out, ref)
    for bad in ([5, 5], [7, 3], [100], [-1]):  # not ascending, beyond the keys, negative
        p = torch.tensor(bad)
        qb = q[: len(bad)]
        with pytest.raises(RuntimeError, match="positions must"):
            kernels.causal_attention(qb, k, v, 1, hd**-0.5, p)
    with pytest.raises(RuntimeError, match="positions must be one sequence"):
        kernels.causal_attention(q, k, v, 1, hd**-0.5, pos.int())


def test_bad_inputs_are_refused(kernels: Kernels) -> None:
    q, k = torch.randn(8, 4, 64).bfloat16(), torch.randn(8, 2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="causal_attention"):
        kernels.causal_attention(q.float(), k, k, 1, 0.125)  # float32
    with pytest.raises(RuntimeError, match="causal_attention"):
        kernels.causal_attention(q, k, k, 3, 0.125)  # 8 rows do not split into 3
    with pytest.raises(RuntimeError, match="causal_attention"):
        kernels.causal_attention(q, k[:4], k[:4], 1, 0.125)  # fewer keys than queries
    with pytest.raises(RuntimeError, match="causal_attention"):
        kernels.causal_attention(q[..., :48], k[..., :48], k[..., :48], 1, 0.125)  # strided
    q48, k48 = torch.randn(8, 4, 48).bfloat16(), torch.randn(8, 2, 48).bfloat16()
    with pytest.raises(RuntimeError, match="causal_attention: needs head_dim % 32"):
        kernels.causal_attention(q48, k48, k48, 1, 0.125)


def test_routing(kernels: Kernels, avx512: bool) -> None:
    """bf16 with head_dim % 32 == 0 takes the kernel where it is built; float32 and odd
    head sizes stay on SDPA."""
    assert attention.causal_kernel(kernels, torch.empty(1, 2, 64).bfloat16()) == avx512
    assert not attention.causal_kernel(kernels, torch.empty(1, 2, 64))
    assert not attention.causal_kernel(kernels, torch.empty(1, 2, 48).bfloat16())
    assert not attention.causal_kernel(None, torch.empty(1, 2, 64).bfloat16())
