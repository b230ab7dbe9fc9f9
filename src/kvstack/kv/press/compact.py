"""Apply a press to a running request: token-level reclamation (in the spirit of vToken).

After the step that completes a request's prompt, the press picks the tokens each layer
and KV head keeps. The survivors are written, in their original order, into *fresh*
blocks; the request's old blocks are released at once::

    old blocks (prompt of 40, bs 16):  [b3: 0..15][b8: 16..31][b5: 32..39 . . . .]
    press keeps 12 tokens per head:     per head its own 12, e.g. 0 1 2 3 17 20 .. 39
    new blocks:                         [b9: 12 survivors . . . .]        2 blocks freed

* **Positions survive.** Keys are stored after RoPE, so a survivor attends exactly as at
  its original position; tokens generated later continue at the next *position* while
  their KV goes to the next free *slot* (``Request.num_kv_tokens``).
* **Heads choose independently.** Slot ``j`` of a layer holds, for each KV head, that
  head's ``j``-th kept token; attention over past tokens needs no per-slot position.
* **Per-layer budgets** (PyramidKV, Layer-DefensiveKV) fill ``max_l m_l`` slots; layer
  ``l`` masks slots ``m_l ..`` (``PressState.layer_lens``).
* **Prefix reuse is never affected.** The old blocks, which may be shared or cached,
  are only released, never rewritten: they still hold the unpressed KV of a true prefix,
  so another request's output never changes because someone else's KV was pressed. The
  new blocks are never entered in the prefix cache.
* If the pool cannot give the new blocks right now, the press is skipped for this
  request, never blocking the batch: counted in ``kvstack:press_skipped_total{reason=
  "no_free_blocks"}`` (``PressCoordinator``) and logged.
* **Pressing again** (``keep``, ``--kv-press-every``): while decoding, the same press
  compacts all the request's slots (survivors and tokens generated since) back to the
  first press's budget; ``num_dropped`` accumulates, so positions still count on.
* **Sliding windows** (Gemma 3, Qwen2 with window layers): the press scores and prunes
  the full-attention layers only, as kvpress does on Gemma 3; each window layer keeps
  its last tokens, enough for its window (``_window_tail``), so it attends exactly as
  unpressed. With the hybrid KV manager every KV group gets its own fresh table and a
  window group pages only for the blocks its window still reads (``_first_live``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstack.core.request import Request
from kvstack.kv.base import KVManager, cdiv
from kvstack.kv.hybrid_cache import first_live
from kvstack.kv.press.base import PressInput
from kvstack.kv.storage import KVStorage

logger = logging.getLogger("kvstack.kv.press")


# Why a press left a request unpressed (``kvstack:press_skipped_total{reason}``).
SKIP_NO_FREE_BLOCKS = "no_free_blocks"  # the survivors' fresh blocks were not free
SKIP_WINDOW_INCOMPLETE = "window_incomplete"  # fewer window queries than the press needs
SKIP_ERROR = "error"  # the press raised (a bug): logged with its traceback
SKIP_REASONS = (SKIP_NO_FREE_BLOCKS, SKIP_WINDOW_INCOMPLETE, SKIP_ERROR)


@dataclass
class PressResult:
    kept: int  # slots in use after the press (max over layers)
    dropped: int
    reclaimed_blocks: int
    skipped: str | None = None  # a ``SKIP_*`` reason: nothing changed


def _select_rows(x: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ``[n, kv_heads, d]``, ``idx`` ``[kv_heads, m]`` -> ``[rows, kv_heads, d]``."""
    kvh, m = idx.shape
    picked = x.permute(1, 0, 2).gather(1, idx[..., None].expand(kvh, m, x.shape[2]))
    out = picked.permute(1, 0, 2)
    if m < rows:
        out = torch.cat((out, out.new_zeros(rows - m, kvh, x.shape[2])))
    return out


def apply_press(
    req: Request,
    queries: list[torch.Tensor] | None,
    kv: KVManager,
    storage: KVStorage,
    scale: float,
    keep: int | None = None,
    windows: Sequence[int | None] = (),
) -> PressResult | None:
    """Press ``req``'s cached tokens now; None when nothing is to drop, a result with
    ``skipped`` set when the survivors' blocks are not free (the request is unchanged).

    ``keep`` presses an already pressed request again, down to ``keep`` slots per head.
    ``windows``: each layer's sliding window (empty: none); only full-attention layers
    are pressed (see ``_window_tail``). Updates ``req.press`` (``PressState``: applied,
    num_dropped, layer_lens); the blocks change only through the ``KVManager`` and
    ``KVStorage`` APIs.
    """
    st = req.press
    assert st is not None
    press = st.press
    if keep is None:
        assert not st.applied and st.num_dropped == 0
    else:  # one budget for all layers (uneven only where a window keeps more, below)
        assert st.applied and press.uniform
    n = req.num_kv_tokens
    num_layers = len(windows) if windows else storage.shape.num_layers
    wins = tuple(windows) or (None,) * num_layers
    full = tuple(i for i, w in enumerate(wins) if w is None)
    tables = _tables(kv, req.request_id)
    of = storage.groups.layer_groups() if storage.groups is not None else [0] * num_layers
    keys, values = _gather(storage, [tables[g] for g in of], n)
    if press.window and queries is None:
        raise RuntimeError(f"press {press.name} needs window queries that were not captured")
    rows = _live_rows(st.layer_lens, full, n) if keep is not None else None
    picked = press.select(
        PressInput(
            [keys[i] if rows is None else keys[i][rows] for i in full],
            [values[i] if rows is None else values[i][rows] for i in full],
            None if queries is None else [queries[i] for i in full],
            scale, keep, full if len(full) < num_layers else None, num_layers,
        )
    )  # fmt: skip
    if rows is not None:
        picked = [rows[idx] for idx in picked]  # indices into all n slots
    st.applied = True  # decided once per (re)computation, even if nothing drops
    if min(int(idx.shape[1]) for idx in picked) >= n:
        return None  # nothing removed anywhere (ratio 0, or a budget as large as the prompt)
    m = max(max(int(idx.shape[1]) for idx in picked), _window_tail(wins, n))
    chosen = dict(zip(full, picked, strict=True))
    kvh = keys[0].shape[1]
    for layer, w in enumerate(wins):
        if w is not None:  # a window layer keeps its last m tokens: all its window reads
            chosen[layer] = torch.arange(n - m, n).expand(kvh, -1)
    first = _first_live(kv, len(tables), wins, of, m)
    new = _allocate(kv, first, m)
    if new is None:
        logger.info("press of %s skipped: no free blocks", req.request_id)
        return PressResult(kept=n, dropped=0, reclaimed_blocks=0, skipped=SKIP_NO_FREE_BLOCKS)
    bs = kv.block_size
    try:
        for layer in range(num_layers):
            g = of[layer]
            pos = torch.arange(first[g] * bs, m)  # a window group writes no null page
            table = torch.tensor(new[g])
            slots = table[pos // bs] * bs + pos % bs
            k = _select_rows(keys[layer], chosen[layer], m)[pos].to(storage.dtype)
            v = _select_rows(values[layer], chosen[layer], m)[pos].to(storage.dtype)
            storage.write(layer, slots, k, v)
    except BaseException:  # the request keeps its old, intact blocks
        kv.release_blocks([b for g, t in enumerate(new) for b in t[first[g] :]])
        raise
    reclaimed = kv.replace_blocks(req, new)
    st.num_dropped += n - m
    lens = [int(chosen[i].shape[1]) for i in range(num_layers)]
    st.layer_lens = lens if min(lens) < m else None
    return PressResult(kept=m, dropped=n - m, reclaimed_blocks=reclaimed)


def _gather(
    storage: KVStorage, tables: list[list[int]], n: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer (``tables[layer]``: its group's block table), the first ``n`` slots' K and
    V as float32 ``[n, kv_heads, head_dim]``."""
    keys, values = [], []
    for layer, table in enumerate(tables):
        k, v = storage.layer(layer).gather(torch.tensor(table))
        keys.append(k.reshape(-1, *k.shape[-2:])[:n].float())
        values.append(v.reshape(-1, *v.shape[-2:])[:n].float())
    return keys, values


def _live_rows(layer_lens: list[int] | None, full: Sequence[int], n: int) -> torch.Tensor | None:
    """Pressing again a request whose full layers mask slots ``m .. M - 1`` (their budget
    ``m`` under a window layer's ``M``, ``_window_tail``): the slots they attend to,
    ``[0, m)`` and ``[M, n)`` (None: every slot). A press with one budget leaves every
    full layer the same ``m``."""
    if layer_lens is None:
        return None
    m = {layer_lens[i] for i in full}
    assert len(m) == 1, f"full layers of different budgets {m} pressed again"
    return torch.cat((torch.arange(m.pop()), torch.arange(max(layer_lens), n)))


def _window_tail(windows: Sequence[int | None], n: int) -> int:
    """Slots every window layer keeps out of ``n``: the ``W - 1`` tokens before the next
    row that its window reads (all ``n`` if fewer). kvpress leaves Gemma 3's sliding
    layers alone; here a window layer keeps its last ``m`` tokens, ``m`` = max(this, the
    full layers' largest budget), so its slots stay consecutive positions ending at the
    next row and the kernels' "last ``W`` slots" is exactly its window::

        n = 12, W = 4, full layers keep m = 5:   positions  0 1 2 3 4 5 6 7 8 9 10 11
          full layer (its press's choice):        slots      0     1   2       3  4
          window layer (the last m):              slots                    0 1 2  3  4
          next row (position 12, slot 5) reads, in the window layer, slots 2..5 = 9..12

    When the full layers keep fewer than this (short prompts, high ratios) they mask
    their slots past their budget (``PressState.layer_lens``), as PyramidKV's smaller
    layers do; the table then holds ``W - 1`` slots. Pressing again (``keep``) scores the
    full layers' unmasked slots only (``_live_rows``) and keeps ``keep`` of them, the
    window layers again their tail."""
    return max((min(n, w - 1) for w in windows if w is not None), default=0)


def _tables(kv: KVManager, request_id: str) -> list[list[int]]:
    """The request's block table per KV group (one group without the hybrid manager)."""
    groups = kv.group_block_ids(request_id)
    return groups if groups is not None else [kv.get_block_ids(request_id)]


def _first_live(
    kv: KVManager,
    num_groups: int,
    windows: Sequence[int | None],
    layer_group: Sequence[int],
    m: int,
) -> list[int]:
    """Per KV group, the first block of a fresh ``m``-slot table that is written: with the
    hybrid manager, a window group's first block its next row (slot ``m``) reads (the
    entries before are the null page 0); 0 otherwise."""
    if num_groups == 1:
        return [0]
    group_window = {layer_group[i]: w for i, w in enumerate(windows)}
    return [first_live(group_window[g], m, kv.block_size) for g in range(num_groups)]


def _allocate(kv: KVManager, first: list[int], m: int) -> list[list[int]] | None:
    """Fresh tables of ``m`` slots per KV group, pages from ``first[g]`` on, or None
    (nothing taken) if the pool is short."""
    need = cdiv(m, kv.block_size)
    pages = kv.allocate_blocks(sum(need - f for f in first))
    if pages is None:
        return None
    fresh = iter(pages)
    return [[0] * f + [next(fresh) for _ in range(need - f)] for f in first]
