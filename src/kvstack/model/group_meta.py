"""Per-group attention metadata for the hybrid KV manager (``kv/hybrid.py``: sliding-window layers).

Every KV group has its own block table, so the pages a step reads and writes differ
per group while everything else (rows, positions, context lengths, masks) is the
same. The runner builds the step's metadata once over *virtual* block ids — request
``r``'s table entry ``i`` is ``base_r + i``, unique in the step, 0 kept for padding —
and each group's metadata maps them through one lookup tensor::

    virtual:   r0: 1 2 3      r1: 4 5          (0 = padding)
    group g:   phys_g = [0, g's r0 table..., g's r1 table...]
    slot s (virtual) -> phys_g[s // bs] * bs + s % bs;  table t -> phys_g[t]

so the per-step Python work is one concatenation of each group's tables, and the
tensors of a group cost one gather each. A window group's freed entries are page 0
(the null page), which only rows older than the window would read: the kernels start
at the window (``window_start``), the PyTorch paths mask it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvstack.model.attention import AttentionMetadata
from kvstack.sched.output import ScheduledRequest


def virtual_tables(
    scheduled: list[ScheduledRequest], num_groups: int
) -> tuple[list[ScheduledRequest], list[torch.Tensor]]:
    """The step's requests with virtual ``block_ids``, and per group ``phys_g``."""
    out: list[ScheduledRequest] = []
    phys: list[list[int]] = [[0] for _ in range(num_groups)]
    base = 1
    for s in scheduled:
        tables = s.group_block_ids
        assert tables is not None and len(tables) == num_groups, "a request without group tables"
        n = len(s.block_ids)
        out.append(replace(s, block_ids=list(range(base, base + n))))
        for g, table in enumerate(tables):
            assert len(table) == n, "group tables of different lengths"
            phys[g].extend(table)
        base += n
    return out, [torch.tensor(p, dtype=torch.long) for p in phys]


def group_metadata(
    meta: AttentionMetadata, phys: list[torch.Tensor], layer_groups: list[int], block_size: int
) -> None:
    """Give ``meta`` one metadata per group (``AttentionMetadata.for_layer``)."""
    bs = block_size
    views = []
    for p in phys:
        kr = meta.kernel_rows
        views.append(
            replace(
                meta,
                slot_mapping=p[meta.slot_mapping // bs] * bs + meta.slot_mapping % bs,
                decode_block_tables=None
                if meta.decode_block_tables is None
                else p[meta.decode_block_tables],
                prefills=[
                    q if q.block_ids is None else replace(q, block_ids=p[q.block_ids])
                    for q in meta.prefills
                ],
                kernel_rows=None if kr is None else replace(kr, block_tables=p[kr.block_tables]),
            )
        )
    meta.groups = views
    meta.layer_groups = layer_groups
