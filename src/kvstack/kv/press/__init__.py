"""Era 5 presses: per-request token eviction after prefill (kvpress's families).

``make_press(name, ratio)`` builds one; ``PRESSES`` lists them. Each press lives in its
own file with the paper it follows; ``compact.py`` applies a press's choice to a
request's blocks (survivors compacted into fewer blocks, the rest reclaimed).
"""

from __future__ import annotations

from kvstack.kv.press.base import Press, PressInput
from kvstack.kv.press.defensivekv import DefensiveKVPress
from kvstack.kv.press.h2o import H2OPress
from kvstack.kv.press.knorm import KnormPress
from kvstack.kv.press.layer_defensivekv import LayerDefensiveKVPress
from kvstack.kv.press.pyramidkv import PyramidKVPress
from kvstack.kv.press.snapkv import SnapKVPress
from kvstack.kv.press.streaming_llm import StreamingLLMPress

PRESSES: dict[str, type[Press]] = {
    p.name: p
    for p in (
        StreamingLLMPress,
        SnapKVPress,
        H2OPress,
        PyramidKVPress,
        KnormPress,
        DefensiveKVPress,
        LayerDefensiveKVPress,
    )
}


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
    if not PRESSES[name].uniform:
        uniform = ", ".join(n for n, p in PRESSES.items() if p.uniform)
        raise ValueError(
            f"kv_press_every needs a press with one budget for all layers ({uniform}); "
            f"{name} gives each layer its own"
        )


def make_press(name: str, ratio: float) -> Press:
    check_press(name, ratio)
    return PRESSES[name](ratio)


__all__ = ["PRESSES", "Press", "PressInput", "check_press", "check_repress", "make_press"]
