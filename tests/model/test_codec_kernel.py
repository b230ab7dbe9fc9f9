"""The C++ codec attention (``paged_attention_codec``: K/V dequantized in the kernel, read
in place from each codec's storage) against the PyTorch reference path (``gather`` and
SDPA), per codec: decodes and short prefill chunks in one call, odd lengths, block
boundaries, KIVI's residual blocks, contexts past a 512-token partition; head_dim 64
(the AVX-512 path, and the AVX2 one on CPUs without AVX-512), 256 with 4 q heads on one KV
head (Gemma 3 270M's shape: the AVX2 path, or the portable one under AVX-512) and 32 (the
portable path); bfloat16 and float32."""

from __future__ import annotations

import pytest
import torch

from kvstack.kv.codecs import CacheShape, KVCodec, codec_class
from kvstack.kv.storage import LayerCache
from kvstack.model.attention import KernelRows, chunk_context, codec_attention, prefill_attention
from kvstack.model.kernels.loader import Kernels

CODECS = ["int8", "fp8", "fp8_e5m2", "int4", "kivi2", "rotated4", "bf16"]
# (KV tokens before, rows): the decodes first (rows = 1), then the chunks.
SEQS = [(4, 1), (299, 1), (40, 1), (0, 12), (21, 11), (1290, 10), (30, 3)]
BS = 16


def _fill(
    codec: KVCodec, g: torch.Generator, dtype: torch.dtype, kvh: int, hd: int, v_scale: float = 1.0
):
    """Each sequence's K/V written in two steps (all but the last 3 tokens, then those),
    as prefill then decode steps do: KIVI blocks fill, quantize or stay residual; values
    times ``v_scale``."""
    perm = torch.randperm(codec.shape.num_blocks, generator=g)
    tables, offset, tails = [], 0, []
    for before, n in SEQS:
        total = before + n
        nb = -(-total // BS)
        table = perm[offset : offset + nb]
        offset += nb
        tables.append(table)
        slots = table[torch.arange(total) // BS] * BS + torch.arange(total) % BS
        k = (torch.randn(total, kvh, hd, generator=g) * 2).to(dtype)
        v = (torch.randn(total, kvh, hd, generator=g) * v_scale).to(dtype)
        k[:, :, 3] += 6.0  # an outlier channel, as real keys have
        codec.write(0, slots[:-3], k[:-3], v[:-3])
        tails.append((slots[-3:], k[-3:], v[-3:]))
    # the last tokens of every sequence in one step: a row's own block is one it wrote
    codec.write(0, *(torch.cat(x) for x in zip(*tails, strict=True)))
    return tables


def _rows(tables: list[torch.Tensor]) -> KernelRows:
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    index = [i for i, (_, n) in enumerate(SEQS) for _ in range(n)]
    lens = [b + j + 1 for b, n in SEQS for j in range(n)]
    return KernelRows(len(lens), padded, torch.tensor(index), torch.tensor(lens))


def _reference(codec: KVCodec, q: torch.Tensor, table: torch.Tensor, before: int, n: int):
    mask = torch.arange(before + n)[None, :] <= torch.arange(before, before + n)[:, None]
    cache = LayerCache(0, codec, None, None)
    keys, vals, mask = chunk_context(cache, table, before, mask)
    return prefill_attention(q, keys, vals, mask, q.shape[-1] ** -0.5)


def _codec(name: str, dtype: torch.dtype, kvh: int, hd: int) -> KVCodec:
    return codec_class(name)(CacheShape(1, 160, BS, kvh, hd), dtype, max_num_seqs=len(SEQS))


CASES = [
    (torch.float32, 64, (9, 3)),
    (torch.bfloat16, 64, (9, 3)),
    (torch.float32, 32, (4, 2)),
    (torch.bfloat16, 32, (4, 2)),
    (torch.bfloat16, 256, (4, 1)),
    # a work item takes min(kvh, 16 // group) KV heads (decode_split.h's kv_heads_per_item,
    # the first head's prefetches taking the others' rows): items of 2, 2 and 1 heads; two of 4
    (torch.bfloat16, 64, (35, 5)),
    (torch.bfloat16, 64, (32, 8)),
]


# bf16 storage is a codec only under float32 models: no bf16-model case for it.
KERNEL_CASES = [
    (name, *case) for case in CASES for name in CODECS if name != "bf16" or case[0] == torch.float32
]


@pytest.mark.parametrize("name,dtype,hd,heads", KERNEL_CASES)
def test_kernel_matches_the_reference_path(
    kernels: Kernels, name: str, dtype: torch.dtype, hd: int, heads: tuple[int, int]
) -> None:
    g = torch.Generator().manual_seed(7)
    h, kvh = heads
    codec = _codec(name, dtype, kvh, hd)
    tables = _fill(codec, g, dtype, kvh, hd)
    view = codec.kernel_view(0)
    assert view is not None, f"{name} declares no kernel view"
    rows = _rows(tables)
    q = torch.randn(rows.num_rows, h, hd, generator=g).to(dtype)
    out = codec_attention(kernels, q, view, rows, hd**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    # bf16: the reference rounds the dequantized K/V (up to ~14 here) and SDPA's output to
    # bf16, the kernel computes in float32 and rounds once at the end
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    r = 0
    for i, (before, n) in enumerate(SEQS):
        ref = _reference(codec, q[r : r + n], tables[i], before, n)
        err = (out[r : r + n].float() - ref.float()).abs().max().item()
        assert err < tol, f"{name} rows of sequence {i} ({before}+{n}): max error {err}"
        r += n


@pytest.mark.parametrize("v_scale", [1e-3, 3e5])
def test_fp8_values_far_from_one_match_the_reference(kernels: Kernels, v_scale: float) -> None:
    """e4m3 V rows go to the P.V pass as float32 bits of value * 2^-120 while the row's
    scale is below 2^7 (codec_rows.h ``e4m3_row64_scaled``), through fp16 above it: tiny
    values (subnormal codes) and huge ones (scale ~3,000) both match the reference."""
    g = torch.Generator().manual_seed(11)
    codec = _codec("fp8", torch.bfloat16, 3, 64)
    tables = _fill(codec, g, torch.bfloat16, 3, 64, v_scale)
    view = codec.kernel_view(0)
    assert view is not None
    rows = _rows(tables)
    q = torch.randn(rows.num_rows, 9, 64, generator=g).to(torch.bfloat16)
    out = codec_attention(kernels, q, view, rows, 64**-0.5)
    assert torch.isfinite(out.float()).all()
    r = 0
    for i, (before, n) in enumerate(SEQS):
        ref = _reference(codec, q[r : r + n], tables[i], before, n)
        err = (out[r : r + n].float() - ref.float()).abs().max().item()
        assert err < 6e-2 * v_scale, f"rows of sequence {i}: max error {err} at {v_scale}"
        r += n


def test_kivi_reads_a_rows_own_block_at_full_precision(kernels: Kernels) -> None:
    """A row's own block comes from the step's full-precision rows (``step_index``): the
    filling block of sequence 2 (its codes are stale: overwriting them changes nothing),
    and block 1 of sequence 6 (30 + 3 tokens), which the last write filled and quantized:
    its own rows (positions 30, 31) read it exactly, the row in block 2 reads its codes."""
    g = torch.Generator().manual_seed(8)
    codec = _codec("kivi2", torch.float32, 3, 64)
    tables = _fill(codec, g, torch.float32, 3, 64)
    rows = _rows(tables)
    q = torch.randn(rows.num_rows, 9, 64, generator=g)
    view = codec.kernel_view(0)
    assert view is not None and view.res_k is not None and view.residual_of is not None
    before = codec_attention(kernels, q, view, rows, 0.125)
    last = int(tables[2][-1])  # sequence 2 holds 41 tokens: its third block is filling
    slot = int(view.residual_of[last])
    assert slot >= 0
    codec.k_codes[0, last] = 0xFF  # type: ignore[attr-defined]
    assert torch.equal(codec_attention(kernels, q, view, rows, 0.125), before)
    view.res_k[slot, 8] += 1.0  # token 40 of sequence 2
    after = codec_attention(kernels, q, view, rows, 0.125)
    assert not torch.equal(after[2], before[2]) and torch.equal(after[:2], before[:2])
    full = int(tables[6][1])
    assert int(codec.residual_of[full]) < 0 <= int(view.residual_of[full])  # type: ignore[attr-defined]
    view.res_k[int(view.residual_of[full])] += 1.0
    moved = codec_attention(kernels, q, view, rows, 0.125)
    assert not torch.equal(moved[-3:-1], after[-3:-1])  # positions 30, 31: block 1 exact
    assert torch.equal(moved[-1], after[-1]) and torch.equal(moved[:-3], after[:-3])


@pytest.mark.parametrize("name", ["int8", "fp8", "int4", "kivi2", "rotated4"])
def test_a_chunk_row_is_scored_exactly_as_a_decode_of_its_position(
    kernels: Kernels, name: str
) -> None:
    """Row j of any chunk equals (bit for bit) a decode at that position, whatever the
    chunking: chunked prefill, prefix hits and plain decodes agree."""
    g = torch.Generator().manual_seed(9)
    codec = _codec(name, torch.bfloat16, 3, 64)
    n = 600
    table = torch.randperm(160, generator=g)[: n // BS + 1]
    slots = table[torch.arange(n) // BS] * BS + torch.arange(n) % BS
    codec.write(0, slots, torch.randn(n, 3, 64, generator=g), torch.randn(n, 3, 64, generator=g))
    view = codec.kernel_view(0)
    assert view is not None
    q = torch.randn(n, 9, 64, generator=g).to(torch.bfloat16)

    def run(start: int, m: int) -> torch.Tensor:
        rows = KernelRows(
            m, table[None], torch.zeros(m, dtype=torch.long), torch.arange(start + 1, start + m + 1)
        )
        return codec_attention(kernels, q[start : start + m], view, rows, 0.125)

    whole = run(0, n)
    for start, m in [(0, 1), (13, 12), (511, 3), (590, 10)]:
        assert torch.equal(run(start, m), whole[start : start + m])


def test_codec_kernel_refuses_bad_input(kernels: Kernels) -> None:
    codec = _codec("int8", torch.float32, 3, 64)
    view = codec.kernel_view(0)
    assert view is not None
    q = torch.zeros(1, 9, 64)
    args = (view.k_codes, view.v_codes, view.k_params, view.v_params, None, None, None, None)
    with pytest.raises(RuntimeError, match="unknown codec layout 'int3'"):
        kernels.paged_attention_codec(
            q, "int3", 0, *args, torch.tensor([[0]]), None, torch.tensor([3]), 0.1
        )
    with pytest.raises(RuntimeError, match="block id 999 outside"):
        kernels.paged_attention_codec(
            q, "int8", 0, *args, torch.tensor([[999]]), None, torch.tensor([3]), 0.1
        )
    with pytest.raises(RuntimeError, match="codes of 64 bytes per row, expected 32"):
        kernels.paged_attention_codec(
            q, "int4", 32, *args, torch.tensor([[0]]), None, torch.tensor([3]), 0.1
        )


WINDOW_CODECS = [c for c in CODECS if c not in ("kivi2", "bf16")]


@pytest.mark.parametrize("window", [8, 100, 700])
@pytest.mark.parametrize("name,dtype,hd,heads", [c for c in KERNEL_CASES if c[0] in WINDOW_CODECS])
def test_kernel_window_matches_the_masked_reference(
    kernels: Kernels, name: str, dtype: torch.dtype, hd: int, heads: tuple[int, int], window: int
) -> None:
    """Sliding windows: row p reads keys (p - W, p] (``model/arch/window.py``); the
    blocks no row of a sequence reads are replaced by a poison block of huge keys in the
    kernel's tables (the hybrid KV manager's freed entries), so reading one would show."""
    from kvstack.model.arch.window import prefill_window_mask

    g = torch.Generator().manual_seed(9)
    h, kvh = heads
    codec = _codec(name, dtype, kvh, hd)
    tables = _fill(codec, g, dtype, kvh, hd)
    used = {int(b) for t in tables for b in t}
    poison = min(set(range(codec.shape.num_blocks)) - used)
    slots = poison * BS + torch.arange(BS)
    huge = torch.full((BS, kvh, hd), 300.0).to(dtype)
    codec.write(0, slots, huge, huge)
    cut = []
    for (before, _), t in zip(SEQS, tables, strict=True):
        first = max(0, before + 1 - window) // BS  # the first row's first key's block
        cut.append(torch.cat([torch.full((first,), poison), t[first:]]))
    view = codec.kernel_view(0)
    assert view is not None
    rows = _rows(cut)
    q = torch.randn(rows.num_rows, h, hd, generator=g).to(dtype)
    out = codec_attention(kernels, q, view, rows, hd**-0.5, window)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    r = 0
    for i, (before, n) in enumerate(SEQS):
        mask = prefill_window_mask(n, before + n, window)
        cache = LayerCache(0, codec, None, None)
        keys, vals, mask = chunk_context(cache, tables[i], before, mask)
        ref = prefill_attention(q[r : r + n], keys, vals, mask, hd**-0.5)
        err = (out[r : r + n].float() - ref.float()).abs().max().item()
        assert err < tol, f"{name} W={window} sequence {i} ({before}+{n}): max error {err}"
        r += n
