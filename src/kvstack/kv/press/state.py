"""``PressState``: one request's press, what it is to do and what it did.

``Request.press`` holds one (None: the request is never pressed); the
``PressCoordinator`` (``coordinator.py``) creates it when the request is added and is
the only code that changes it. The scheduler, KV manager and runner only read it.

Token accounting of a pressed request (``Request.num_kv_tokens``)::

    positions:  0 1 2 3 4 5 6 7 8 9 | 10 11      (prompt of 10, 2 generated)
    kept:       0 1     4     7 8 9 | 10 11      (press kept 6 of 10)
    slots:      0 1     2     3 4 5 |  6  7      (num_dropped = 4)

Invariants:

* ``1 <= point <= the prompt length``; ``every`` is None or ``press.uniform``;
* until ``applied`` (set once the press ran on the current computation, even when it
  dropped nothing; a preemption resets it): ``num_dropped == 0``, ``layer_lens is
  None``, ``budget == 0``, ``window is None``;
* ``layer_lens`` is None or one kept-token count per layer, not all equal (the request
  uses ``max(layer_lens)`` slots, layer ``l`` masks slots ``layer_lens[l] ..``);
* ``window`` is None or per layer ``[w, heads, head_dim]`` float32 queries with
  ``1 <= w <= press.window``, held only while re-pressing (``every`` set);
* ``observed`` is None or per layer ``[w, heads, head_dim]`` float32 queries with
  ``1 <= w <= min(press.window, point)``, held only while pending: the queries of the
  prompt's last ``press.window`` tokens before the press point computed so far (they may
  arrive over several prefill chunks; the scheduler never adopts them from the cache).

Plain Python: no torch import at runtime (the query windows are opaque here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvstack.kv.press.base import Press


@dataclass
class PressState:
    press: Press
    point: int  # computed tokens after which the press runs (prompt, or kv_press_after)
    # Press again whenever the slots reach ``budget + every`` (None: press once).
    every: int | None = None
    applied: bool = False
    budget: int = 0  # slots the first press kept (the budget a re-press holds)
    num_dropped: int = 0  # cached tokens the presses removed (slots = positions - this)
    layer_lens: list[int] | None = None  # kept tokens per layer when budgets differ
    # Re-pressing: the queries of the last ``press.window`` tokens, per layer.
    window: list[torch.Tensor] | None = field(default=None, repr=False)
    # Pending: the queries of the window before ``point`` computed so far, per layer.
    observed: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def pending(self) -> bool:
        """True until the press ran on the current computation of the request."""
        return not self.applied

    @property
    def keep(self) -> int:
        """Tokens per head a press again keeps in each full-attention layer: ``budget``,
        or, when window layers keep more slots (``kv/press/compact.py``), the full
        layers' count (the smallest of ``layer_lens``: re-pressing needs one budget)."""
        return self.budget if self.layer_lens is None else min(self.layer_lens)

    @property
    def repressing(self) -> bool:
        """True while the request holds a budget by pressing again as it decodes."""
        return self.applied and self.every is not None

    def reset(self) -> None:
        """Forget the press's effect (preemption: everything is recomputed, then pressed)."""
        self.applied = False
        self.budget = 0
        self.num_dropped = 0
        self.layer_lens = None
        self.window = None
        self.observed = None

    def check(self) -> None:
        """Assert the invariants of the module docstring."""
        assert self.point >= 1, f"press point {self.point}"
        assert self.every is None or (self.every >= 1 and self.press.uniform)
        if not self.applied:
            assert self.num_dropped == 0 and self.layer_lens is None and self.budget == 0
            assert self.window is None, "a pending press holds no query window"
        else:
            assert self.observed is None, "an applied press holds no prompt window"
        if self.observed is not None:
            rows = {int(q.shape[0]) for q in self.observed}
            assert len(rows) == 1, f"prompt windows of different lengths {rows}"
            w = rows.pop()
            assert 1 <= w <= min(self.press.window, self.point), f"prompt window of {w} rows"
        assert self.num_dropped >= 0
        if self.layer_lens is not None:
            assert min(self.layer_lens) < max(self.layer_lens), "even layer_lens must be None"
        if self.window is not None:
            assert self.every is not None, "only a re-pressing request holds queries"
            rows = {int(q.shape[0]) for q in self.window}
            assert len(rows) == 1, f"query windows of different lengths {rows}"
            assert 1 <= rows.pop() <= self.press.window, "query window longer than the press's"
