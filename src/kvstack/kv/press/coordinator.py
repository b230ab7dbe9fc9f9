"""``PressCoordinator``: the presses in one place, and the hooks the engine's parts call.

A request with a press gets a ``PressState`` (``state.py``) in ``Request.press`` when it
is added; the coordinator keeps every live one by request id and is the only code that
changes them. Who calls what, in step order::

    engine.add_request   resolve(sampling_params) -> PressSpec | None   (validation)
                         on_request_added(request, spec)
    scheduler.schedule   max_cached_blocks(...)   prefix reuse stops before the window
                         max_new_tokens(...)      a prefill chunk stops at the press point
                         on_request_preempted(r)  recomputed later, then pressed again
    runner.execute       capture_rows(...)        the chunk's rows whose queries a press needs
    engine.step          after_step(requests, queries)   collect the window, press / hold
    scheduler            on_request_finished(id)  (stop, length, abort, error)

**The observation window never depends on how the prompt was computed.** A press with a
``window`` scores with the queries of the last ``window`` tokens before its press point,
whether the prompt was fresh, came partly from the prefix cache (or an offload tier) or
was prefilled in chunks of any size:

* the scheduler adopts cached blocks only up to ``point - window`` (rounded down to a
  block): the window's tokens are always recomputed, so their queries exist. This is
  the "recompute" choice rather than keeping hidden states with the prefix blocks. Cost:
  a prefix hit recomputes up to ``window + block_size - 1`` tokens instead of up to
  ``block_size`` (SnapKV / PyramidKV 64 + 15, DefensiveKV 32 + 15, H2O 256 + 15 with
  16-token blocks), only for requests whose press is pending; nothing extra is stored
  per cached block;
* ``capture_rows`` asks the runner for every row of a chunk inside the window, and
  ``after_step`` appends them to ``PressState.observed`` until the point is computed, so
  a window split over chunks is whole when the press runs. Cost: the window's queries,
  ``window x layers x heads x head_dim`` float32, held between the chunks of a pending
  request (SmolLM2-135M: 4.2 MiB for a 64-query window, 16.9 MiB for H2O's 256).

``after_step`` presses each request whose press point this step computed
(``kv/press/compact.py`` compacts its survivors into fresh blocks), and presses again a
request holding a budget (``every``) once its slots reach ``budget + every``. A press
that fails is logged and costs the compression, never the request. Every press left
undone is counted by reason (``PressCounters.skipped``, the Prometheus counter
``kvstack:press_skipped_total{reason}``): ``no_free_blocks``, ``window_incomplete`` (the
window's queries were not all computed: never expected, so it is counted rather than
pressing on a partial window) and ``error``.

Invariants (``check_integrity``): the coordinator holds a state exactly for each live
request with a press, and it is that request's ``Request.press``; each state keeps the
invariants of ``PressState``. Plain Python: the query tensors pass through opaquely.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstack.core.errors import InvalidRequestError
from kvstack.kv.press import check_repress, make_press
from kvstack.kv.press.base import Press, append_window, nothing_to_press
from kvstack.kv.press.compact import (
    SKIP_ERROR,
    SKIP_REASONS,
    SKIP_WINDOW_INCOMPLETE,
    PressResult,
    apply_press,
)
from kvstack.kv.press.state import PressState

if TYPE_CHECKING:
    import torch

    from kvstack.core.request import Request, SamplingParams
    from kvstack.kv.base import KVManager
    from kvstack.kv.storage import KVStorage

logger = logging.getLogger("kvstack.kv.press")

Queries = list["torch.Tensor"]  # per layer [rows, heads, head_dim] float32


@dataclass(frozen=True)
class PressDefaults:
    """The engine's press options (``CacheConfig``), used where a request sets none."""

    name: str | None = None
    ratio: float = 0.0
    every: int | None = None
    paged: bool = True  # presses compact blocks: the paged layout only
    # Each layer's sliding window (None: full attention; empty: none slides). Presses
    # compress the full-attention layers only (``compact.py``, ``model/arch/window.py``).
    windows: tuple[int | None, ...] = ()

    @property
    def window_error(self) -> str | None:
        """Why no press can run on this model (every layer slides), else None."""
        return nothing_to_press(self.windows)


@dataclass(frozen=True)
class PressSpec:
    """What ``resolve`` decided for one request (its ``n`` children share it)."""

    press: Press
    every: int | None = None
    after: int | None = None  # press after this many prompt tokens (kv_press_after)

    def point(self, num_prompt_tokens: int) -> int:
        """Computed tokens after which the press runs."""
        if self.after is None:
            return num_prompt_tokens
        return min(self.after, num_prompt_tokens)


@dataclass
class PressCounters:
    """Totals since the engine started (``EngineStats.num_press_*`` and friends)."""

    pressed_requests: int = 0  # first presses that compacted a request
    dropped_tokens: int = 0
    input_tokens: int = 0  # cached tokens the presses looked at (dropped / input: share)
    represses: int = 0  # presses again while decoding (``every``)
    reclaimed_blocks: int = 0  # blocks compaction returned to the pool
    # Presses left undone, by reason (``compact.SKIP_REASONS``; every reason listed).
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))


class PressCoordinator:
    def __init__(
        self, defaults: PressDefaults, kv: KVManager, storage: KVStorage, scale: float
    ) -> None:
        self.defaults = defaults
        self.kv = kv
        self.storage = storage
        self.scale = scale  # attention scale (head_dim ** -0.5)
        self.states: dict[str, PressState] = {}
        self.counters = PressCounters()

    # ------------------------------------------------------------------ engine: admission
    def resolve(self, sp: SamplingParams) -> PressSpec | None:
        """The press a request gets and how often it presses again while decoding: its
        own ``kv_press`` / ``kv_press_ratio`` / ``kv_press_every`` or the engine's.

        Raises ``InvalidRequestError``; None when the request is not pressed (ratio 0
        removes nothing: no press at all)."""
        d = self.defaults
        name = sp.kv_press if sp.kv_press is not None else d.name
        ratio = sp.kv_press_ratio if sp.kv_press_ratio is not None else d.ratio
        every = sp.kv_press_every if sp.kv_press_every is not None else d.every
        if sp.kv_press_ratio is not None and name is None:
            raise InvalidRequestError(
                "kv_press_ratio needs a kv_press (request or --kv-press)", param="kv_press_ratio"
            )
        if sp.kv_press_every is not None and name is None:
            raise InvalidRequestError(
                "kv_press_every needs a kv_press (request or --kv-press)", param="kv_press_every"
            )
        if name is None:
            return None
        if not d.paged:
            raise InvalidRequestError("KV presses need the paged layout")
        if d.window_error is not None:
            raise InvalidRequestError(d.window_error, "kv_press")
        try:
            press = make_press(name, ratio)
            if every is not None:
                check_repress(name)
        except ValueError as e:
            raise InvalidRequestError(str(e), "kv_press_every" if every else None) from None
        if ratio == 0:
            return None
        return PressSpec(press, every, sp.kv_press_after)

    def on_request_added(self, req: Request, spec: PressSpec | None) -> None:
        """Give a queued request its press state (``spec`` from ``resolve``)."""
        if spec is None:
            req.press = None
            return
        req.press = PressState(spec.press, spec.point(req.num_prompt_tokens), spec.every)
        self.states[req.request_id] = req.press

    # ------------------------------------------------------------------ scheduler
    @staticmethod
    def max_cached_blocks(req: Request, num_blocks: int, block_size: int) -> int:
        """Prefix-cache blocks ``req`` may adopt: while its press is pending, none that
        reach into the window before the press point (its queries must be computed), and
        at least one token is computed (the press runs after the step reaching the point)."""
        st = req.press
        if st is None or st.applied:
            return num_blocks
        return min(num_blocks, max(0, st.point - max(1, st.press.window)) // block_size)

    @staticmethod
    def max_new_tokens(req: Request, num_computed: int, num_new: int) -> int:
        """``num_new`` capped so a chunk stops at the press point while it is pending."""
        st = req.press
        if st is None or st.applied or num_computed >= st.point:
            return num_new
        return min(num_new, st.point - num_computed)

    def on_request_preempted(self, req: Request) -> None:
        """The request lost its KV; it is recomputed from scratch, then pressed again."""
        if req.press is not None:
            req.press.reset()

    def on_request_finished(self, request_id: str) -> None:
        """Forget a finished request (its ``Request.press`` stays readable)."""
        st = self.states.pop(request_id, None)
        if st is not None:
            st.window = st.observed = None

    # ------------------------------------------------------------------ runner
    @staticmethod
    def capture_rows(req: Request, num_computed: int, num_new: int) -> tuple[int, int] | None:
        """The rows ``[lo, hi)`` of this chunk (offsets into ``[num_computed, num_computed
        + num_new)``) whose queries the press needs, or None: while pending, those inside
        the window ``[point - window, point)``; while pressing again, the chunk's last
        ``window`` rows (decoded tokens)."""
        st = req.press
        if st is None or not st.press.window:
            return None
        window = st.press.window
        if st.pending:
            lo = max(num_computed, st.point - window) - num_computed
            hi = min(num_computed + num_new, st.point) - num_computed
            return (lo, hi) if hi > lo else None
        if st.every is None:
            return None
        return (num_new - min(window, num_new), num_new)

    # ------------------------------------------------------------------ engine: after the step
    def after_step(self, requests: Iterable[Request], queries: Mapping[str, Queries]) -> None:
        """Press every request whose press point this step computed, and press again those
        holding a budget. ``requests``: the step's; ``queries``: what the runner captured."""
        if not self.states:
            return  # no live request has a press (the usual case): nothing to look at
        for req in requests:
            st = req.press
            if st is None or req.is_finished():
                continue
            q = queries.get(req.request_id)
            if st.pending:
                if q is not None:
                    st.observed = append_window(st.observed, q, st.press.window)
                if req.num_computed_tokens >= st.point:
                    held, st.observed = st.observed, None
                    res = self._press_prompt(req, st, held)
                    st.budget = res.kept if res is not None else req.num_kv_tokens
            elif st.every is not None:
                self._hold_budget(req, st, q)

    def _press_prompt(
        self, req: Request, st: PressState, queries: Queries | None
    ) -> PressResult | None:
        """The first press, once the point is computed, with the whole prompt window."""
        window = st.press.window
        if window:
            rows = None if queries is None else int(queries[0].shape[0])
            if rows != min(window, st.point):
                logger.warning(
                    "press %s of %s skipped: %s of the %d window queries were computed",
                    st.press.name, req.request_id, rows or 0, min(window, st.point),
                )  # fmt: skip
                st.applied = True
                self.counters.skipped[SKIP_WINDOW_INCOMPLETE] += 1
                return None
        return self._press(req, st, queries, None)

    def _hold_budget(self, req: Request, st: PressState, queries: Queries | None) -> None:
        """Keep the queries of the request's last ``window`` tokens; once its slots reach
        ``budget + every``, press them back to ``budget``."""
        assert st.every is not None
        window = st.press.window
        if window and queries is not None:
            st.window = append_window(st.window, queries, window)
        if req.num_kv_tokens < st.budget + st.every:
            return
        held, st.window = st.window, None
        if window and held is None:
            return  # no decode queries yet (just recomputed after a preemption)
        if self._press(req, st, held, st.keep) is not None:
            self.counters.represses += 1

    def _press(
        self, req: Request, st: PressState, queries: Queries | None, keep: int | None
    ) -> PressResult | None:
        try:
            res = self._compact(req, st, queries, keep)
        except Exception:  # a press bug costs the compression, never the request
            logger.exception("press %s failed on %s; left unpressed", st.press.name, req.request_id)
            st.applied = True
            st.every = None
            st.observed = None
            self.counters.skipped[SKIP_ERROR] += 1
            return None
        if res is not None and res.skipped is not None:
            self.counters.skipped[res.skipped] += 1
            return None
        if res is not None:
            c = self.counters
            if keep is None:
                c.pressed_requests += 1
            c.dropped_tokens += res.dropped
            c.input_tokens += res.dropped + res.kept
            c.reclaimed_blocks += res.reclaimed_blocks
        return res

    def _compact(
        self, req: Request, st: PressState, queries: Queries | None, keep: int | None
    ) -> PressResult | None:
        """``compact.apply_press`` on ``req`` (it updates ``req.press``, which is ``st``)."""
        assert req.press is st
        windows = self.defaults.windows
        return apply_press(req, queries, self.kv, self.storage, self.scale, keep, windows)

    # ------------------------------------------------------------------ introspection
    def check_integrity(self, requests: Mapping[str, Request]) -> None:
        """``requests``: the live ones (the scheduler's table)."""
        live = {rid for rid, r in requests.items() if r.press is not None}
        assert set(self.states) == live, (
            f"press states {sorted(self.states)} != pressed live requests {sorted(live)}"
        )
        for rid, st in self.states.items():
            assert requests[rid].press is st, f"{rid}: request and coordinator disagree"
            st.check()
            assert requests[rid].num_kv_tokens >= 0
