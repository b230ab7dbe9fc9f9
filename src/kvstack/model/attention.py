"""Attention over the paged KV cache, for a flattened batch of prefill and decode tokens.

Rows of one step are ordered decodes first, then prefill chunks::

    rows:  [d0 d1 ... d(D-1) | p0 p0 p0 p0 | p1 p1 p1 | ...]
            one token each      chunk of req p0, chunk of req p1

* Decode rows (one new token, any context length) attend together. With the C++
  kernel (``csrc/paged_attention.cpp``) K/V are read in place through the block
  tables; contexts are cut into 512-token partitions, each scored by one task (AVX512-BF16
  dot products for bf16 caches) and merged by their softmax maxima and sums (flash-
  decoding), so one long request still uses every core. Codecs without a kernel view and
  uneven press budgets take the PyTorch path below, counted in
  ``kvstack:kernel_fallback_total`` (reasons ``encoded_cache``, ``uneven_press``).
  The PyTorch fallback gathers the keys of all D requests once per layer into
  ``[D, L]`` and runs two grouped-query matmuls with a length mask (measured: CPU
  SDPA is 12x slower at q_len 1 on a 2-core AMD EPYC).
* With the C++ kernels and an unencoded cache, or a codec that declares a ``KernelView``
  (every built-in one: ``kv/codecs/``), the decodes and every prefill chunk of at
  most ``KERNEL_CHUNK_ROWS`` rows (a short suffix after a prefix hit, the tail of a
  chunked prompt, several tokens to verify; every chunk for kivi2, whose rows must not
  depend on the chunk's shape: ``ModelRunner.kernel_chunk_rows``) go to one
  ``paged_attention`` call per layer
  (``KernelRows``): a chunk row at KV position ``p`` is scored exactly as a decode whose
  context is ``p + 1`` tokens, through its sequence's block table, K/V read in place
  (its own K/V were just written): no mask, no gather. An encoded cache goes to
  ``paged_attention_codec`` (``csrc/paged_attention_codecs.cpp``), which dequantizes
  each row as it reads it (``codec_attention``); the ``gather`` path below stays as the
  tested reference (``KVSTACK_NO_KERNELS=1``). That per-row scoring re-reads the
  context for each row, so longer chunks stay with SDPA below, which is faster from
  ~16 rows on (measured at 200 and 1,000-token contexts, bf16, one thread: 8 chunks of
  4 rows 0.28 vs 1.09 ms, of 32 rows 2.05 vs 1.81 ms at 200 tokens).
* A prefill chunk that starts a sequence (no earlier KV) attends to its own fresh K/V
  causally; a chunk that continues one (chunked prefill, recompute after preemption, or a
  prefix hit) gathers the earlier KV from its blocks. In bf16 both go to the C++
  ``causal_attention`` (``csrc/prefill_attention.cpp``: AVX512-BF16 dot products, 3.5-4x
  PyTorch's CPU flash attention on 10 x 200-token prompts) unless a window, an uneven
  press or a codec's own-block reads shape the mask; float32 and the rest take SDPA.
  Segment repair rows (segment reuse: positions spread over the context) are one sparse
  sequence (``PrefillSeq.positions``) that the same kernel takes, row ``i`` seeing keys
  ``0 .. positions[i]``. Query ``i`` of a chunk of ``q`` tokens ending at context length
  ``c`` sees keys ``0 .. c - q + i``::

        keys:    0 1 2 3 4 5 6 7      (c = 8, q = 3)
        query 0: x x x x x x          position 5
        query 1: x x x x x x x        position 6
        query 2: x x x x x x x x      position 7

* A sliding-window layer (``window``; Mistral, Qwen2's sliding layers, Gemma 3's local
  layers) sees only keys ``(p - W, p]`` on every path: the kernels start each row at key
  ``max(0, L - W)``, the PyTorch paths mask the older keys (``model/arch/window.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvstack.kv.codecs import KernelView
from kvstack.kv.storage import LayerCache
from kvstack.model.arch.window import decode_window_bias, prefill_window_mask
from kvstack.model.kernels import isa
from kvstack.model.kernels.loader import Kernels, note_fallback


@dataclass
class PrefillSeq:
    """One prefill chunk, or ``num_seqs`` fresh prompts of equal length run as one batch.

    With ``num_seqs > 1`` the rows ``q_start .. q_start + num_seqs * q_len`` hold that
    many whole prompts (no earlier KV) back to back: one causal SDPA call covers them.
    """

    q_start: int  # first row of this chunk in the flattened batch
    q_len: int
    ctx_len: int  # tokens with KV after this step (earlier + this chunk)
    block_ids: torch.Tensor | None  # [n_blocks] long; None when ctx_len == q_len
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = may attend; None if pure causal
    num_seqs: int = 1
    layer_masks: list[torch.Tensor] | None = None  # per layer, after an uneven press
    offset_causal: bool = False  # mask is exactly: row i sees keys 0 .. ctx_len - q_len + i
    # Sparse rows (segment repair): row i sits at positions[i] (ascending) and sees keys
    # 0 .. positions[i], its own K/V among them (the mask says the same).
    positions: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # per window, lazily

    def mask_for(self, layer: int, window: int | None) -> torch.Tensor | None:
        """The mask of ``layer`` (None: causal); a window masks keys older than it (for
        sparse rows, older than each row's own position's window)."""
        if window is not None:
            if window not in self.window_masks:
                self.window_masks[window] = prefill_window_mask(
                    self.q_len, self.ctx_len, window, self.positions
                )
            return self.window_masks[window]
        return self.layer_masks[layer] if self.layer_masks is not None else self.mask


KERNEL_CHUNK_ROWS = 12  # prefill chunks up to this length take the C++ kernel


@dataclass
class KernelRows:
    """Rows of a step for the C++ ``paged_attention``: the first ``num_rows`` rows
    (decodes, then prefill chunks of at most ``KERNEL_CHUNK_ROWS`` rows, then segment
    repair rows), or the step rows ``rows`` names when other rows sit between them (the
    repair rows come after every prefill chunk: ``model/segment_rows.py``). Kernel row
    ``r`` reads block table ``table_index[r]`` up to ``context_lens[r]`` tokens
    (``table_index`` None: one table per row, decodes only). Tables are padded with
    block 0 past their length."""

    num_rows: int
    block_tables: torch.Tensor  # [S, max_blocks] long
    table_index: torch.Tensor | None  # [R] long
    context_lens: torch.Tensor  # [R] long
    rows: torch.Tensor | None = None  # [R] long: the step rows, when not 0 .. R - 1


KernelSeq = tuple[list[int], list[int]]  # a block table and its rows' context lengths


def make_kernel_rows(
    seqs: list[KernelSeq], one_per_row: bool, tail: list[tuple[list[int], list[int], int]]
) -> KernelRows | None:
    """``KernelRows`` of a step: the rows of ``seqs`` from row 0 on, then each of ``tail``
    (table, context lengths, its first step row) at its own rows. ``one_per_row``: each
    seq is one decode (no table index). None without rows."""
    entries = [*seqs, *((t, lens) for t, lens, _ in tail)]
    if not entries:
        return None
    tables: list[list[int]] = []
    index: list[int] = []
    lens: list[int] = []
    for table, ls in entries:
        index.extend([len(tables)] * len(ls))
        tables.append(table)
        lens.extend(ls)
    head = sum(len(ls) for _, ls in seqs)
    rows = None
    if tail and tail[0][2] != head:  # prefill chunks sit between
        step_rows = [*range(head), *(r + j for _, ls, r in tail for j in range(len(ls)))]
        rows = torch.tensor(step_rows, dtype=torch.long)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return KernelRows(
        num_rows=len(lens),
        block_tables=torch.tensor(padded, dtype=torch.long),
        table_index=None if one_per_row and not tail else torch.tensor(index, dtype=torch.long),
        context_lens=torch.tensor(lens, dtype=torch.long),
        rows=rows,
    )


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long, where each new token's K/V goes
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [D] long (context incl. the new token)
    decode_bias: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size]; fallback path only
    prefills: list[PrefillSeq]
    kernels: Kernels | None = None  # torch.ops.kvstack (model/kernels/loader.py) if built
    # Per-layer decode bias [layers, D, 1, 1, S] when a pressed request keeps different
    # token counts per layer (PyramidKV, Layer-DefensiveKV); replaces decode_bias.
    decode_layer_bias: torch.Tensor | None = None
    # Presses: request id -> rows whose queries the press needs, and what the model
    # captured for them (per layer [rows, heads, head_dim] float32).
    capture_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    captured: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # The rows that go to the C++ kernel (``prefills`` holds the others).
    kernel_rows: KernelRows | None = None
    # Window -> decode_bias with the slots older than it masked (lazily, fallback path).
    window_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    # Hybrid KV manager (model/group_meta.py): per KV group its metadata, per layer its group.
    groups: list[AttentionMetadata] | None = None
    layer_groups: list[int] | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata ``layer`` reads and writes through (its KV group's tables)."""
        if self.groups is None or self.layer_groups is None:
            return self
        return self.groups[self.layer_groups[layer]]

    def decode_bias_for(self, layer: int, window: int | None) -> torch.Tensor:
        """The fallback decode path's additive mask for ``layer`` (windowed if ``window``)."""
        if self.decode_layer_bias is not None:  # an uneven press; a window masks on top
            bias = self.decode_layer_bias[layer]
            if window is None:
                return bias
            assert self.decode_context_lens is not None
            return decode_window_bias(bias, self.decode_context_lens, window)
        assert self.decode_bias is not None
        if window is None:
            return self.decode_bias
        if window not in self.window_bias:
            assert self.decode_context_lens is not None
            self.window_bias[window] = decode_window_bias(
                self.decode_bias, self.decode_context_lens, window
            )
        return self.window_bias[window]


def capture_queries(meta: AttentionMetadata, q: torch.Tensor) -> None:
    """Presses: keep one layer's queries of the rows a press needs (``capture_rows``), float32
    copies appended per request, one per layer in layer order (``captured``)."""
    for rid, (r0, r1) in meta.capture_rows.items():
        meta.captured.setdefault(rid, []).append(q[r0:r1].to(torch.float32, copy=True))


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q ``[D, H, d]``; gathered keys/values ``[D, L, KVH, d]``; returns ``[D, H, d]``."""
    d_, h, hd = q.shape
    kvh = keys.shape[2]
    keys = keys.transpose(1, 2)  # [D, KVH, L, d]
    vals = vals.transpose(1, 2)
    qg = q.view(d_, kvh, h // kvh, hd)  # [D, KVH, G, d]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale + bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, vals).view(d_, h, hd)


_causal_available: bool | None = None


def causal_kernel(kernels: Kernels | None, q: torch.Tensor) -> bool:
    """Whether ``causal_attention`` (``csrc/prefill_attention.cpp``: AVX512-BF16) takes
    this step's bf16 prefill chunks; float32 stays on SDPA (bit-comparable with
    transformers), and so does a CPU without AVX512-BF16 (designed, not counted)."""
    return causal_kernel_takes(kernels, q.dtype, q.shape[-1])


def causal_kernel_takes(kernels: Kernels | None, dtype: torch.dtype, head_dim: int) -> bool:
    """``causal_kernel`` for queries of ``dtype`` and ``head_dim``."""
    global _causal_available
    if kernels is None or dtype != torch.bfloat16 or head_dim % 32:
        return False
    if _causal_available is None:  # model/kernels/isa.py: built at the AVX512-BF16 levels only
        _causal_available = isa.causal_attention() and bool(kernels.causal_attention_available())
    return _causal_available


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    num_seqs: int = 1,
) -> torch.Tensor:
    """q ``[S*q, H, d]``, k/v ``[S*c, KVH, d]`` for S sequences; causal when ``mask`` is None."""
    s = num_seqs
    out = F.scaled_dot_product_attention(
        q.unflatten(0, (s, -1)).transpose(1, 2),
        k.unflatten(0, (s, -1)).transpose(1, 2),
        v.unflatten(0, (s, -1)).transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).flatten(0, 1)


def codec_attention(
    kernels: Kernels,
    q: torch.Tensor,
    view: KernelView,
    rows: KernelRows,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """``rows`` over an encoded cache read in place by ``paged_attention_codec``.

    rotated4 (``view.rotation_signs``: R orthogonal): its codes hold ``k R``, and ``q . k
    = (q R) . (k R)`` and ``sum_t p_t v_t = (sum_t p_t v_t R) R^T``, so the kernel rotates
    the query once before and the output once after, instead of every key and value
    (QuaRot's online Hadamard, on the query side), each row on its own.
    """
    out: torch.Tensor = kernels.paged_attention_codec(
        q, view.layout, view.group, view.k_codes, view.v_codes, view.k_params,
        view.v_params, view.res_k, view.res_v, view.residual_of, view.rotation_signs,
        rows.block_tables, rows.table_index, rows.context_lens, scale, window,
    )  # fmt: skip
    return out


def chunk_context(
    cache: LayerCache,
    block_ids: torch.Tensor,
    kc: int,
    mask: torch.Tensor,
    kernels: Kernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and mask ``[n, ...]`` for the ``n`` rows of a chunk after ``kc`` KV
    tokens, through its blocks (``block_ids`` cover ``kc + n`` tokens, ``mask`` ``[n, kc +
    n]``). For a codec with ``own_block_exact`` each row reads the blocks before its own
    one through ``gather`` and its own block through ``gather_own``: the keys are the
    ``kc + n`` encoded tokens followed by the tokens from the chunk's first block on, as
    their own rows read them, and row ``p`` may attend an encoded token ``j < bs * (p //
    bs)`` or an own-block token ``bs * (p // bs) <= j <= p``::

        bs 4, kc 6, n 4:    encoded 0..9           own-block rows 4..9
        row 6 (block 1):    x x x x . . . . . .    x x x . . .
        row 8 (block 2):    x x x x x x x x . .    . . . . x .
    """
    kb, vb = cache.gather(block_ids, kernels)  # per-token codecs, kivi2: codec_gather
    bs, kvh, hd = kb.shape[-3], kb.shape[-2], kb.shape[-1]
    n = mask.shape[0]
    kk = kb.view(-1, kvh, hd)[: kc + n]
    vv = vb.view(-1, kvh, hd)[: kc + n]
    if not cache.own_block_exact:
        return kk, vv, mask
    first = kc // bs
    own_ids = block_ids[first:]
    ko, vo = cache.overlay_own(own_ids, kb[first:].clone(), vb[first:].clone())
    s0 = first * bs
    own_start = (torch.arange(kc, kc + n) // bs * bs)[:, None]
    j = torch.arange(kc + n)[None, :]
    keys = torch.cat((kk, ko.view(-1, kvh, hd)[: kc + n - s0]))
    vals = torch.cat((vv, vo.view(-1, kvh, hd)[: kc + n - s0]))
    both = torch.cat((mask & (j < own_start), mask[:, s0:] & (j[:, s0:] >= own_start)), 1)
    return keys, vals, both


def _decode_rows(
    q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float, window: int
) -> torch.Tensor:
    """Decode rows without ``KernelRows``: the C++ decode kernel, or (encoded caches,
    uneven presses, no kernels) the PyTorch gather path, counted as a fallback."""
    nd = q.shape[0]
    assert meta.decode_block_tables is not None
    layer_bias = meta.decode_layer_bias
    if meta.kernels is not None and cache.k is not None and layer_bias is None:
        assert meta.decode_context_lens is not None
        out: torch.Tensor = meta.kernels.paged_decode_attention(
            q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, scale, window
        )
        return out
    if meta.kernels is not None and cache.layer == 0:  # counted, once per step
        reason = "encoded_cache" if cache.k is None else "uneven_press"
        note_fallback("paged_decode_attention", reason)
    bias = meta.decode_bias_for(cache.layer, window or None)
    tables = meta.decode_block_tables
    keys, vals = cache.gather(tables)  # [D, blocks, bs, KVH, d]
    kvh, hd = keys.shape[-2], keys.shape[-1]
    if cache.own_block_exact:  # each row's last block as the rows inside it read it
        assert meta.decode_context_lens is not None
        rows = torch.arange(nd)
        own = (meta.decode_context_lens - 1) // keys.shape[2]
        keys[rows, own], vals[rows, own] = cache.gather_own(tables[rows, own])
    return decode_attention(q, keys.view(nd, -1, kvh, hd), vals.view(nd, -1, kvh, hd), bias, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for all rows of a step. The new K/V must already be in the cache.

    q ``[T, H, d]``, k/v ``[T, KVH, d]`` (this step's); ``cache`` is one layer of the
    KV storage. Unencoded caches are read in place (the C++ decode kernel, or indexing);
    an encoded one (a KV codec) is read through ``cache.gather``, which dequantizes
    just the blocks a row needs. ``window``: this layer's sliding window (None: every key;
    ``model/arch/window.py``). Returns ``[T, H, d]``.
    """
    every = meta.kernel_rows
    w = window or 0  # the kernels' "no window"
    if every is not None and meta.kernels is not None:
        idx = every.rows
        if idx is not None:
            rows_q = q[idx]
        else:
            rows_q = q if every.num_rows == q.shape[0] else q[: every.num_rows]
        if cache.k is not None:
            head = meta.kernels.paged_attention(
                rows_q, cache.k, cache.v, every.block_tables, every.table_index,
                every.context_lens, scale, w,
            )  # fmt: skip
        else:  # the runner sets kernel_rows for an encoded cache only with a kernel view
            view = cache.kernel_view
            assert view is not None, "kernel rows over a cache the kernel cannot read"
            head = codec_attention(meta.kernels, rows_q, view, every, scale, w)
        if not meta.prefills:  # (``rows`` is set only with prefill rows between)
            return head
        out = torch.empty_like(q)
        if idx is None:
            out[: every.num_rows] = head
        else:
            out[idx] = head
    else:
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = _decode_rows(q[: meta.num_decodes], cache, meta, scale, w)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.num_seqs * p.q_len)
        mask = p.mask_for(cache.layer, window)
        # Plain causal (fresh prompts, or a chunk after its context with the runner's
        # offset-causal mask): the C++ kernel, unless a window, a press or a codec's
        # own-block reads shape the mask.
        ordered = p.offset_causal or p.positions is not None  # the mask is causal in position
        causal = (
            window is None
            and p.layer_masks is None
            and (p.block_ids is None or (ordered and not cache.own_block_exact))
        )
        if p.block_ids is None:
            kk, vv = k[rows], v[rows]
        else:
            assert mask is not None
            kk, vv, mask = chunk_context(
                cache, p.block_ids, p.ctx_len - p.q_len, mask, meta.kernels
            )
        if causal and causal_kernel(meta.kernels, q):
            out[rows] = meta.kernels.causal_attention(  # type: ignore[union-attr]
                q[rows], kk, vv, p.num_seqs, scale, p.positions
            )
        else:
            out[rows] = prefill_attention(q[rows], kk, vv, mask, scale, p.num_seqs)
    return out
