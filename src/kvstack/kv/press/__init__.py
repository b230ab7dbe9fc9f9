"""KV presses: per-request token eviction after prefill (kvpress's families).

``make_press(name, ratio)`` builds one; ``PRESSES`` (a ``Registry``) names them. Each
press lives in its own file with the paper it follows; ``compact.py`` applies a press's
choice to a request's blocks (survivors compacted into fewer blocks, the rest
reclaimed); ``coordinator.py`` holds each request's press state (``state.py``) and the
hooks the scheduler, runner and engine call. A new press: a ``Press`` subclass in its own
file, entered below.
"""

from __future__ import annotations

from kvstack.core.registry import Registry
from kvstack.kv.press.base import Press, PressInput
from kvstack.kv.press.defensivekv import DefensiveKVPress
from kvstack.kv.press.h2o import H2OPress
from kvstack.kv.press.knorm import KnormPress
from kvstack.kv.press.layer_defensivekv import LayerDefensiveKVPress
from kvstack.kv.press.pyramidkv import PyramidKVPress
from kvstack.kv.press.snapkv import SnapKVPress
from kvstack.kv.press.streaming_llm import StreamingLLMPress

# In the order ``--help`` and error messages list them.
PRESSES: Registry[type[Press]] = Registry("press")
for _press, _help in (
    (StreamingLLMPress, "attention sinks + the most recent tokens"),
    (SnapKVPress, "the prompt's last queries vote for earlier keys, pooled"),
    (H2OPress, "heavy hitters (most attended) + recent tokens"),
    (PyramidKVPress, "SnapKV with per-layer budgets, large at the bottom"),
    (KnormPress, "keep the keys of smallest L2 norm (no queries)"),
    (DefensiveKVPress, "worst-case instead of mean aggregation of window scores"),
    (LayerDefensiveKVPress, "DefensiveKV with budgets shared across layers"),
):
    PRESSES.add(_press.name, _press, f"{_help} ({_press.paper})")


def check_press(name: str | None, ratio: float) -> None:
    """Raise ``ValueError`` with a clear message for an unknown press or a bad ratio."""
    if name is not None and name not in PRESSES:
        raise ValueError(f"unknown kv_press {name!r}; choose one of: {', '.join(PRESSES)}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"kv_press_ratio must be in [0, 1), got {ratio}")


def check_repress(name: str) -> None:
    """Raise ``ValueError`` unless press ``name`` can be applied again while decoding.

    Re-pressing compacts all of a request's slots to one budget; presses with per-layer
    budgets (PyramidKV, Layer-DefensiveKV) leave layers of different lengths, whose
    later tokens share slots with masked ones, so they press once, after the prompt.
    """
    if not PRESSES.get(name).uniform:
        uniform = ", ".join(n for n, p in PRESSES.items() if p.uniform)
        raise ValueError(
            f"kv_press_every needs a press with one budget for all layers ({uniform}); "
            f"{name} gives each layer its own"
        )


def make_press(name: str, ratio: float) -> Press:
    check_press(name, ratio)
    return PRESSES.get(name)(ratio)


__all__ = ["PRESSES", "Press", "PressInput", "check_press", "check_repress", "make_press"]
