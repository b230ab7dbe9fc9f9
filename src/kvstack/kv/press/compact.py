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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvstack.kv.base import KVManager, cdiv
from kvstack.kv.press.base import PressInput
from kvstack.kv.storage import KVStorage
from kvstack.request import Request

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
) -> PressResult | None:
    """Press ``req``'s cached tokens now; None when nothing is to drop, a result with
    ``skipped`` set when the survivors' blocks are not free (the request is unchanged).

    ``keep`` presses an already pressed request again, down to ``keep`` slots per head.
    Updates ``req.press`` (``PressState``: applied, num_dropped, layer_lens); the blocks
    change only through the ``KVManager`` and ``KVStorage`` APIs.
    """
    st = req.press
    assert st is not None
    press = st.press
    if keep is None:
        assert not st.applied and st.num_dropped == 0
    else:
        assert st.applied and st.layer_lens is None and press.uniform
    n = req.num_kv_tokens
    bs = kv.block_size
    ids = torch.tensor(kv.get_block_ids(req.request_id))
    keys, values = [], []
    for layer in range(storage.shape.num_layers):
        k, v = storage.layer(layer).gather(ids)
        keys.append(k.reshape(-1, *k.shape[-2:])[:n].float())
        values.append(v.reshape(-1, *v.shape[-2:])[:n].float())
    if press.window and queries is None:
        raise RuntimeError(f"press {press.name} needs window queries that were not captured")
    chosen = press.select(PressInput(keys, values, queries, scale, keep))
    lens = [int(idx.shape[1]) for idx in chosen]
    m = max(lens)
    st.applied = True  # decided once per (re)computation, even if nothing drops
    if min(lens) >= n:
        return None  # nothing removed anywhere (ratio 0, or a budget as large as the prompt)
    need = cdiv(m, bs)
    new = kv.allocate_blocks(need)
    if new is None:
        logger.info("press of %s skipped: no %d free blocks", req.request_id, need)
        return PressResult(kept=n, dropped=0, reclaimed_blocks=0, skipped=SKIP_NO_FREE_BLOCKS)
    pos = torch.arange(m)
    table = torch.tensor(new)
    slots = table[pos // bs] * bs + pos % bs
    try:
        for layer, idx in enumerate(chosen):
            k = _select_rows(keys[layer], idx, m).to(storage.dtype)
            v = _select_rows(values[layer], idx, m).to(storage.dtype)
            storage.write(layer, slots, k, v)
    except BaseException:
        kv.release_blocks(new)  # the request keeps its old, intact blocks
        raise
    reclaimed = kv.replace_blocks(req, new)
    st.num_dropped += n - m
    st.layer_lens = lens if min(lens) < m else None
    return PressResult(kept=m, dropped=n - m, reclaimed_blocks=reclaimed)
