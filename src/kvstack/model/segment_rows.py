"""The runner's side of segment reuse: copy, re-rotate, choose, recompute.

Before a step's forward, each ``SegmentImport`` of the step copies a segment entry's KV
(computed standalone at positions ``s + i``) into the request's slots at positions
``a + i``, every layer. Values copy as they are; keys are re-rotated: RoPE rotates each
channel pair by ``p * theta_j``, so a key computed at ``s + i`` becomes the key at
``a + i`` by ``R(a + i) R(s + i)^T``. This uses the model's own cos/sin tables at both
positions (not ``R(a - s)``): the result then equals the key computed in place up to the
rounding of two rotations (float32: ~1e-7 relative), whatever the positions.
(EPIC's alternative keeps keys before RoPE and rotates in attention; kvstack re-rotates
once per copy and keeps the attention kernels unchanged; the copy costs one gather and
one write per layer, and its blocks count in the request's memory.)

Repair (CacheBlend, Yao et al., EuroSys 2025): of each ``RecomputeSpan`` the first
``first`` tokens are recomputed (EPIC's first-k), and ``count`` of the others: those
whose layer-1 KV deviates most from the copy. To find them, a *probe* runs the
candidates through layer 0 (attention over the copied KV, which at layer 0 is exact:
layer-0 KV depends only on the token and its position) and layer 1's projections, which
writes their fresh layer-0/1 KV; the deviation is ``|k1' - k1|^2 + |v1' - v1|^2``
summed over heads. Like CacheBlend, layer 1 thus ends recomputed for every candidate,
and from layer 2 on only the chosen rows are. Chosen rows then run with the step as
extra rows after every chunk; a row at position ``p`` attends to keys ``0 .. p``::

    keys:        0 1 2 3 4 5 6 7 8     rows 2 and 5 recomputed, chunk 7..8
    row p=2:     x x x
    row p=5:     x x x x x x
    chunk p=7:   x x x x x x x x       (sees rows 2 and 5's new KV at every layer:
    chunk p=8:   x x x x x x x x x      all of a step's KV is written before attention)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstack.model.arch.layers import Rotary, apply_rope
from kvstack.model.attention import (
    AttentionMetadata,
    KernelSeq,
    PrefillSeq,
    causal_kernel_takes,
    make_kernel_rows,
)
from kvstack.sched.output import ScheduledRequest

if TYPE_CHECKING:
    from kvstack.kv.storage import KVStorage
    from kvstack.model.arch.decoder import LlamaModel
    from kvstack.model.kernels.loader import Kernels


def rerotate(k: torch.Tensor, rotary: Rotary, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Keys ``[T, KVH, d]`` rotated at positions ``src`` turned into keys at ``dst``."""
    x = k.float()
    base = apply_rope(x, rotary.cos[src][:, None], -rotary.sin[src][:, None])
    return apply_rope(base, rotary.cos[dst][:, None], rotary.sin[dst][:, None])


def _slots(block_ids: Sequence[int], positions: Sequence[int], bs: int) -> torch.Tensor:
    return torch.tensor([block_ids[p // bs] * bs + p % bs for p in positions], dtype=torch.long)


def apply_imports(scheduled: Sequence[ScheduledRequest], kv: KVStorage, model: LlamaModel) -> None:
    """Copy every ``SegmentImport`` of the step into its request's slots (all layers)."""
    bs = kv.block_size
    src_slots: list[torch.Tensor] = []
    dst_slots: list[torch.Tensor] = []
    src_pos: list[int] = []
    dst_pos: list[int] = []
    for s in scheduled:
        for imp in s.segment_imports:
            src = range(imp.src_start, imp.src_start + imp.length)
            dst = range(imp.dst_start, imp.dst_start + imp.length)
            src_slots.append(_slots(imp.src_block_ids, src, bs))
            dst_slots.append(_slots(s.block_ids, dst, bs))
            src_pos.extend(p + imp.src_shift for p in src)
            dst_pos.extend(dst)
    if not src_slots:
        return
    sslot, dslot = torch.cat(src_slots), torch.cat(dst_slots)
    spos, dpos = torch.tensor(src_pos), torch.tensor(dst_pos)
    with torch.inference_mode():
        for layer in range(model.config.num_layers):
            k, v = read_slots(kv, layer, sslot)
            k = rerotate(k, model.rotary_for(layer), spos, dpos)
            kv.layer(layer).write(dslot, k.to(v.dtype), v)


def read_slots(kv: KVStorage, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[T, KVH, d]`` (decoded) of single slots of one layer."""
    bs = kv.block_size
    blocks, inverse = torch.unique(slots // bs, return_inverse=True)
    k, v = kv.layer(layer).gather(blocks)
    rows = inverse * bs + slots % bs
    return k.flatten(0, 1)[rows], v.flatten(0, 1)[rows]


def sparse_seq(
    s: ScheduledRequest, positions: list[int], row: int, bs: int
) -> tuple[torch.Tensor, PrefillSeq]:
    """Slots of rows at ``positions`` (sorted) of ``s``'s request and their attention:
    row ``p`` sees keys ``0 .. p`` through the block table."""
    ctx = positions[-1] + 1
    table = torch.tensor(s.block_ids[: -(-ctx // bs)], dtype=torch.long)
    p = torch.tensor(positions)
    mask = torch.arange(ctx)[None, :] <= p[:, None]
    slots = table[p // bs] * bs + p % bs
    return slots, PrefillSeq(row, len(positions), ctx, table, mask, positions=p)


def _probe(
    s: ScheduledRequest,
    candidates: list[int],
    kv: KVStorage,
    model: LlamaModel,
    kernels: Kernels | None,
    paged: bool,
) -> torch.Tensor:
    """Layer-1 KV deviation of each candidate (CacheBlend's selection), ``[n]``
    (``paged``: as decode-like rows of the paged kernel, ``rows_on_paged_kernel``)."""
    bs = kv.block_size
    slots, seq = sparse_seq(s, candidates, 0, bs)
    k_old, v_old = (t.float() for t in read_slots(kv, 1, slots))
    meta = AttentionMetadata(slots, 0, None, None, None, [seq], kernels=kernels)
    if paged:  # row p reads keys 0 .. p in place
        meta.prefills = []
        meta.kernel_rows = make_kernel_rows([_kernel_seq(s, candidates, bs)], False, [])
    tokens = s.request.all_token_ids
    ids = torch.tensor([tokens[p] for p in candidates])
    model.forward(ids, torch.tensor(candidates), meta, kv, None, stop_after_kv_of=1)
    k_new, v_new = (t.float() for t in read_slots(kv, 1, slots))
    return ((k_new - k_old) ** 2).sum((1, 2)) + ((v_new - v_old) ** 2).sum((1, 2))


def rows_on_paged_kernel(kernels: Kernels | None, model: LlamaModel, kernel: bool) -> bool:
    """Where the repair rows (and the probe's) attend: True, the C++ paged kernel as
    decode-like rows (``kernel``: the step's codec is one it reads); False, one sparse
    sequence each, which bf16 runs on the C++ causal prefill kernel (``causal_attention``
    with the rows' positions: the context packed once per KV head, tiles of 32 rows,
    instead of every row reading it again), else SDPA with the mask."""
    cfg = model.config
    return kernel and not causal_kernel_takes(kernels, model.dtype, cfg.head_dim)


def _kernel_seq(s: ScheduledRequest, positions: list[int], bs: int) -> KernelSeq:
    """Rows at ``positions`` (sorted) for the C++ paged kernel: row ``p`` reads keys
    ``0 .. p`` through the request's block table (the keys of ``sparse_seq``'s mask)."""
    return s.block_ids[: -(-(positions[-1] + 1) // bs)], [p + 1 for p in positions]


def choose_rows(
    s: ScheduledRequest,
    kv: KVStorage,
    model: LlamaModel,
    kernels: Kernels | None,
    paged: bool = False,
) -> list[int]:
    """The positions ``s`` recomputes: each span's first tokens and its most deviating."""
    chosen: list[int] = []
    probe_spans = []
    for r in s.recompute:
        first_end = min(r.start + r.first, r.end)
        chosen.extend(range(r.start, first_end))
        rest = list(range(first_end, r.end))
        if r.count >= len(rest):
            chosen.extend(rest)
        elif r.count > 0:
            probe_spans.append((rest, r.count))
    if probe_spans and model.config.num_layers > 1:
        candidates = [p for rest, _ in probe_spans for p in rest]
        dev = _probe(s, candidates, kv, model, kernels, paged)
        at = 0
        for rest, count in probe_spans:
            top = torch.topk(dev[at : at + len(rest)], count).indices.tolist()
            chosen.extend(rest[i] for i in top)
            at += len(rest)
    return sorted(chosen)


Repair = list[tuple[ScheduledRequest, list[int]]]


def segment_rows(
    scheduled: Sequence[ScheduledRequest],
    kv: KVStorage,
    model: LlamaModel,
    kernels: Kernels | None,
    kernel: bool = False,
) -> Repair:
    """Copy the step's segments in, then choose each copying request's repair rows
    (``kernel``: the step's codec is one the C++ paged kernel reads)."""
    if not any(s.segment_imports for s in scheduled):
        return []
    apply_imports(scheduled, kv, model)
    paged = rows_on_paged_kernel(kernels, model, kernel)
    return [(s, choose_rows(s, kv, model, kernels, paged)) for s in scheduled if s.recompute]


def append_rows(
    repair: Repair,
    bs: int,
    ids: list[int],
    positions: list[int],
    slots: list[int],
    prefills: list[PrefillSeq],
    kernel_tail: list[tuple[list[int], list[int], int]] | None = None,
) -> None:
    """Add the repair rows after every other row of the step: one sparse sequence each,
    or with ``kernel_tail`` rows of the C++ paged kernel (row ``p`` reads keys
    ``0 .. p`` through the block table: the same keys, no mask, no gather)."""
    for s, rows in repair:
        if not rows:
            continue
        row_slots, seq = sparse_seq(s, rows, len(ids), bs)
        if kernel_tail is not None:
            kernel_tail.append((*_kernel_seq(s, rows, bs), len(ids)))
        else:
            prefills.append(seq)
        tokens = s.request.all_token_ids
        ids.extend(tokens[p] for p in rows)
        positions.extend(rows)
        slots.extend(row_slots.tolist())
