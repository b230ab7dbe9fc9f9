"""The ``Press`` protocol: which cached tokens a request keeps (token eviction).

A press looks at one request's KV right after its prompt is computed and returns, per
layer, the tokens each KV head keeps (kvpress's ``score -> top-k``; NVIDIA kvpress,
2024). ``ratio`` is the fraction of KV *removed*, as in kvpress: ``ratio = 0`` keeps
everything, a "20 % budget" is ``ratio = 0.8``. A request of ``n`` cached tokens keeps
``m = max(1, int(n * (1 - ratio)))`` per head and layer (kvpress's ``compute_n_kept``)
unless the press sets per-layer budgets (PyramidKV, Layer-DefensiveKV).

Presses that score with attention get the queries of the prompt's last ``window`` tokens
(post-RoPE) and compute attention of those queries only, ``[heads, window, n]`` per
layer: never an ``n x n`` matrix. The window is always the last ``window`` tokens before
the press point, however the prompt was computed: the scheduler never adopts cached
prefix blocks inside the window (those tokens are recomputed), and the coordinator
collects the window's queries across prefill chunks (``coordinator.py``).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F


@dataclass
class PressInput:
    """One request's cached KV, all layers, float32."""

    keys: list[torch.Tensor]  # per layer [n, kv_heads, head_dim], post-RoPE
    values: list[torch.Tensor]
    queries: list[torch.Tensor] | None  # per layer [w, heads, head_dim]: last w rows
    scale: float  # attention scale (head_dim ** -0.5)
    # Tokens to keep per head and layer when pressing again during decode (the budget
    # the first press left); None: the press's own ratio of ``n``.
    keep: int | None = None
    # The model layer of each entry (None: entry ``i`` is layer ``i``) and the model's
    # layer count (0: ``num_layers``). A sliding-window model's press gets only its
    # full-attention layers (``compact.py``); PyramidKV's schedule counts model layers.
    layers: tuple[int, ...] | None = None
    total_layers: int = 0

    @property
    def n(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def model_layers(self) -> tuple[int, ...]:
        """The model layer of each entry."""
        return self.layers if self.layers is not None else tuple(range(self.num_layers))

    @property
    def num_model_layers(self) -> int:
        return self.total_layers or self.num_layers


class Press(abc.ABC):
    name: ClassVar[str]
    paper: ClassVar[str]
    window: ClassVar[int] = 0  # trailing prompt queries the press needs (0: none)
    uniform: ClassVar[bool] = True  # one budget for all layers (re-pressable)

    def __init__(self, ratio: float) -> None:
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"press ratio must be in [0, 1), got {ratio}")
        self.ratio = ratio

    def budget(self, n: int) -> int:
        """Tokens kept per head and layer out of ``n``: kvpress's ``compute_n_kept``
        (``int`` of the kept share, at least 1)."""
        return max(1, int(n * (1 - self.ratio)))

    def kept(self, inp: PressInput) -> int:
        """Tokens to keep for this input: ``inp.keep`` when re-pressing, else ``budget``."""
        return min(inp.n, inp.keep) if inp.keep is not None else self.budget(inp.n)

    @abc.abstractmethod
    def select(self, inp: PressInput) -> list[torch.Tensor]:
        """Per layer, ``[kv_heads, m_l]`` sorted indices of the kept tokens (``m_l <= n``)."""


def nothing_to_press(windows: tuple[int | None, ...]) -> str | None:
    """Why no press can run on a model whose layers have these sliding windows (None: full
    attention): every layer slides, and presses compress full-attention layers only (as
    kvpress skips ``is_sliding`` layers). None when some layer attends fully (or none is
    known). The one wording of the startup ``ConfigError`` and the per-request 400."""
    if windows and all(w is not None for w in windows):
        return (
            "every layer of this model uses sliding-window attention; a KV press "
            "compresses only full-attention layers (as kvpress does), so there is "
            "nothing to press"
        )
    return None


def append_window(
    old: list[torch.Tensor] | None, new: list[torch.Tensor], window: int
) -> list[torch.Tensor]:
    """Per layer, the last ``window`` rows of ``old`` followed by ``new`` (the queries of
    a prompt's window arriving chunk by chunk, or of the tokens decoded since the last
    press)."""
    if old is None:
        return [q[-window:] for q in new]
    return [torch.cat((o, q))[-window:] for o, q in zip(old, new, strict=True)]


def top_with_tail(scores: torch.Tensor, m: int, tail: int) -> torch.Tensor:
    """Keep the last ``tail`` tokens and the ``m - tail`` best-scored others, per head.

    ``scores`` ``[kv_heads, n - tail]`` scores the tokens before the tail. Returns sorted
    ``[kv_heads, m]`` indices into the ``n`` tokens. (kvpress pads the window's scores
    with ``max + 1`` and takes one top-k: the same set whenever ``m >= tail``; with
    ``m < tail`` kvpress keeps whichever window tokens its top-k's tie-break picks,
    kvstack the last ``m``.)
    """
    kvh, head = scores.shape
    n = head + tail
    if m >= n:
        return torch.arange(n).expand(kvh, -1)
    if m <= tail:
        return torch.arange(n - m, n).expand(kvh, -1)
    best = scores.topk(m - tail, dim=-1).indices
    recent = torch.arange(head, n).expand(kvh, -1)
    return torch.cat((best, recent), dim=-1).sort(dim=-1).values


def window_attention(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of the last ``w`` queries over all ``n`` keys: ``[heads, w, n]``.

    Query ``i`` sits at position ``n - w + i`` and sees keys ``0 .. n - w + i`` (causal).
    The arithmetic is kvpress's ``SnapKVPress.compute_window_attention`` step for step
    (per query head against its group's keys, logits divided by ``sqrt(head_dim)``, a
    triangular ``-inf`` mask, softmax in float32), so the scores are the same floats;
    memory is ``heads * (w + head_dim) * n`` floats.
    """
    w, h, d = q.shape
    n, kvh, _ = k.shape
    keys = k.permute(1, 2, 0).repeat_interleave(h // kvh, dim=0)  # [h, d, n] (repeat_kv)
    logits = torch.matmul(q.permute(1, 0, 2), keys)  # [h, w, n]
    logits = logits / math.sqrt(d) if scale == d**-0.5 else logits * scale
    mask = torch.triu(torch.full((w, n), -math.inf), diagonal=n - w + 1)
    return torch.softmax(logits + mask, dim=-1, dtype=torch.float32)


def window_scores(inp: PressInput, layer: int, window: int) -> tuple[torch.Tensor, int]:
    """Attention of the window's queries on the keys before the window, ``[heads, w, n - w]``,
    and the window length ``w`` actually used (shorter for short prompts: at most
    ``n - 1``, where kvpress requires ``n > window``)."""
    assert inp.queries is not None, "this press needs the prompt's window queries"
    q = inp.queries[layer]
    w = min(window, q.shape[0], inp.n - 1)
    probs = window_attention(q[-w:], inp.keys[layer], inp.scale)[..., : inp.n - w]
    return probs, w


def pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """SnapKV's smoothing along the keys (last dim): average pooling of width ``kernel``,
    stride 1, zero padding ``kernel // 2`` counted in the mean (``F.avg_pool1d``'s
    default, as SnapKV's and kvpress's code), same length as the input."""
    shape = scores.shape
    rows = scores.reshape(1, -1, shape[-1])  # rows as channels, as kvpress's [batch, heads, n]
    out = F.avg_pool1d(rows, kernel, stride=1, padding=kernel // 2)
    return out[..., : shape[-1]].reshape(shape)


class WindowScorePress(Press):
    """A press that scores each layer's tokens before its observation window and keeps
    the best ``m - w`` plus the window (SnapKV's family)."""

    window: ClassVar[int] = 64
    kernel: ClassVar[int] = 5

    @abc.abstractmethod
    def layer_scores(self, inp: PressInput, layer: int) -> tuple[torch.Tensor, int]:
        """``[kv_heads, n - w]`` scores of the tokens before the window, and ``w``."""

    def select(self, inp: PressInput) -> list[torch.Tensor]:
        m = self.kept(inp)
        out = []
        for layer in range(inp.num_layers):
            scores, w = self.layer_scores(inp, layer)
            out.append(top_with_tail(scores, m, w))
        return out
