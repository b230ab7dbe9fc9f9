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
  ``[D, L]`` and runs two grouped-query matmuls with a length mask (DESIGN.md: CPU
  SDPA is 12x slower at q_len 1).
* With the C++ kernels and an unencoded cache, or a codec that declares a ``KernelView``
  (every built-in one: ``kv/codecs/``), the decodes and every prefill chunk of at
  most ``KERNEL_CHUNK_ROWS`` rows (a short suffix after a prefix hit, the tail of a
  chunked prompt, several tokens to verify) go to one ``paged_attention`` call per layer
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
  with causal SDPA; a chunk that continues one (chunked prefill, recompute after
  preemption, or a prefix hit) gathers the earlier KV from its blocks. Query ``i`` of a
  chunk of ``q`` tokens ending at context length ``c`` sees keys ``0 .. c - q + i``::

        keys:    0 1 2 3 4 5 6 7      (c = 8, q = 3)
        query 0: x x x x x x          position 5
        query 1: x x x x x x x        position 6
        query 2: x x x x x x x x      position 7
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvstack.kv.codecs import KernelView
from kvstack.kv.storage import LayerCache
from kvstack.model.kernels import Kernels, note_fallback


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


KERNEL_CHUNK_ROWS = 12  # prefill chunks up to this length take the C++ kernel


@dataclass
class KernelRows:
    """The first ``num_rows`` rows of a step (decodes, then prefill chunks of at most
    ``KERNEL_CHUNK_ROWS`` rows) for the C++ ``paged_attention``: row ``r`` reads block
    table ``table_index[r]`` up to ``context_lens[r]`` tokens (``table_index`` None: one
    table per row, decodes only). Tables are padded with block 0 past their length."""

    num_rows: int
    block_tables: torch.Tensor  # [S, max_blocks] long
    table_index: torch.Tensor | None  # [R] long
    context_lens: torch.Tensor  # [R] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long, where each new token's K/V goes
    num_decodes: int  # rows [0, num_decodes) are single-token decodes
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long
    decode_context_lens: torch.Tensor | None  # [D] long (context incl. the new token)
    decode_bias: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size]; fallback path only
    prefills: list[PrefillSeq]
    kernels: Kernels | None = None  # torch.ops.kvstack (model/kernels.py) if built
    # Per-layer decode bias [layers, D, 1, 1, S] when a pressed request keeps different
    # token counts per layer (PyramidKV, Layer-DefensiveKV); replaces decode_bias.
    decode_layer_bias: torch.Tensor | None = None
    # Era 5 presses: request id -> rows whose queries the press needs, and what the model
    # captured for them (per layer [rows, heads, head_dim] float32).
    capture_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    captured: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # Set when every row goes to the C++ kernel (then ``prefills`` is empty).
    kernel_rows: KernelRows | None = None


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
    kernels: Kernels, q: torch.Tensor, view: KernelView, rows: KernelRows, scale: float
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
        rows.block_tables, rows.table_index, rows.context_lens, scale,
    )  # fmt: skip
    return out


def _decode_rows(
    q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode rows without ``KernelRows``: the C++ decode kernel, or (encoded caches,
    uneven presses, no kernels) the PyTorch gather path, counted as a fallback."""
    nd = q.shape[0]
    assert meta.decode_block_tables is not None
    layer_bias = meta.decode_layer_bias
    if meta.kernels is not None and cache.k is not None and layer_bias is None:
        assert meta.decode_context_lens is not None
        out: torch.Tensor = meta.kernels.paged_decode_attention(
            q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, scale
        )
        return out
    if meta.kernels is not None and cache.layer == 0:  # counted, once per step
        reason = "encoded_cache" if cache.k is None else "uneven_press"
        note_fallback("paged_decode_attention", reason)
    bias = layer_bias[cache.layer] if layer_bias is not None else meta.decode_bias
    assert bias is not None
    keys, vals = cache.gather(meta.decode_block_tables)  # [D, blocks, bs, KVH, d]
    kvh, hd = keys.shape[-2], keys.shape[-1]
    return decode_attention(q, keys.view(nd, -1, kvh, hd), vals.view(nd, -1, kvh, hd), bias, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for all rows of a step. The new K/V must already be in the cache.

    q ``[T, H, d]``, k/v ``[T, KVH, d]`` (this step's); ``cache`` is one layer of the
    KV storage. Unencoded caches are read in place (the C++ decode kernel, or indexing);
    an encoded one (era 5 codecs) is read through ``cache.gather``, which dequantizes
    just the blocks a row needs. Returns ``[T, H, d]``.
    """
    every = meta.kernel_rows
    if every is not None and meta.kernels is not None:
        rows_q = q if every.num_rows == q.shape[0] else q[: every.num_rows]
        if cache.k is not None:
            head = meta.kernels.paged_attention(
                rows_q, cache.k, cache.v, every.block_tables, every.table_index,
                every.context_lens, scale,
            )  # fmt: skip
        else:  # the runner sets kernel_rows for an encoded cache only with a kernel view
            view = cache.kernel_view
            assert view is not None, "kernel rows over a cache the kernel cannot read"
            head = codec_attention(meta.kernels, rows_q, view, every, scale)
        if not meta.prefills:
            return head
        out = torch.empty_like(q)
        out[: every.num_rows] = head
    else:
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = _decode_rows(q[: meta.num_decodes], cache, meta, scale)
    kvh, hd = k.shape[1], k.shape[2]
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.num_seqs * p.q_len)
        if p.block_ids is None:
            kk, vv = k[rows], v[rows]
        else:
            kb, vb = cache.gather(p.block_ids)
            kk = kb.view(-1, kvh, hd)[: p.ctx_len]
            vv = vb.view(-1, kvh, hd)[: p.ctx_len]
        mask = p.layer_masks[cache.layer] if p.layer_masks is not None else p.mask
        out[rows] = prefill_attention(q[rows], kk, vv, mask, scale, p.num_seqs)
    return out
