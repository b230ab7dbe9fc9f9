"""The codec attention's fast score readers for bf16 queries (``codec_int8.h``: int8 codes
against an int16 query; ``codec_int4.h``: int4 / rotated4 nibbles, per-group scales after
the partial reduction; ``codec_fp8.h``: fp8 codes' own bits as bf16) against float64
attention over the same dequantized K/V: errors stay at the bf16 output's rounding,
far inside ``test_codec_kernel.py``'s tolerance for the bf16 reference path, for every
GQA ratio the fast path compiles (1, 2, 3, 4, 8 q heads per KV head)."""

from __future__ import annotations

import pytest
import torch

from kvstack.kv.codecs import CacheShape, codec_class
from kvstack.kv.codecs.per_token import PerTokenCodec
from kvstack.model.attention import KernelRows, codec_attention
from kvstack.model.kernels.loader import Kernels

BS = 16


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2", "int4", "rotated4"])
def test_fast_readers_match_float64_attention(
    kernels: Kernels, name: str, heads: tuple[int, int]
) -> None:
    h, kvh = heads
    g = torch.Generator().manual_seed(h * 10 + kvh)
    lens = [1, 17, 600, 1100]  # one token, a partial block, two and three partitions
    nb = [-(-n // BS) for n in lens]
    codec = codec_class(name)(CacheShape(1, sum(nb) + 1, BS, kvh, 64), torch.bfloat16, 4)
    assert isinstance(codec, PerTokenCodec)
    perm = 1 + torch.randperm(sum(nb), generator=g)
    tables = torch.zeros(len(lens), max(nb), dtype=torch.long)
    for i, n in enumerate(lens):
        tables[i, : nb[i]] = perm[sum(nb[:i]) : sum(nb[: i + 1])]
        slots = tables[i, torch.arange(n) // BS] * BS + torch.arange(n) % BS
        k = torch.randn(n, kvh, 64, generator=g) * 2
        k[:, :, 7] += 5.0  # an outlier channel
        codec.write(0, slots, k.bfloat16(), torch.randn(n, kvh, 64, generator=g).bfloat16())
    q = (torch.randn(len(lens), h, 64, generator=g) * 1.5).bfloat16()
    view = codec.kernel_view(0)
    assert view is not None
    rows = KernelRows(len(lens), tables, None, torch.tensor(lens))
    out = codec_attention(kernels, q, view, rows, 0.125).double()
    kc, kp = codec.k_codes[0].flatten(0, 1), codec.k_params[0].flatten(0, 1)
    vc, vp = codec.v_codes[0].flatten(0, 1), codec.v_params[0].flatten(0, 1)
    for i, n in enumerate(lens):
        slots = tables[i, torch.arange(n) // BS] * BS + torch.arange(n) % BS
        key = codec.decode(kc[slots], kp[slots]).double()  # dequantized (rotated4: back)
        val = codec.decode(vc[slots], vp[slots]).double()
        kk = key.repeat_interleave(h // kvh, 1)  # [n, h, 64]
        vv = val.repeat_interleave(h // kvh, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kk) * 0.125, -1)
        want = torch.einsum("hn,nhd->hd", p, vv)
        err = (out[i] - want).abs().max().item()
        # the output is rounded to bf16 once (|out| < 4: 2^-7 at most), the query's int16
        # rounding and float32 sums add far less
        assert err < 1.2e-2, f"{name} {heads} row {i} ({n} tokens): max error {err}"
