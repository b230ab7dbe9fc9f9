"""Sliding-window attention: which keys a query of a windowed layer sees.

A layer with window ``W`` (``ModelConfig.layer_window``) lets the query at position ``p``
attend keys ``(p - W, p]``: itself and the ``W - 1`` before it, as transformers'
``masking_utils.sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``, on top
of the causal mask), which Mistral (``modeling_mistral.py``), Qwen2's sliding layers and
Gemma 3's local layers (``modeling_gemma3.py``) all use::

    W = 4, a chunk of q = 3 queries ending at context c = 8 (keys 0 .. 7)

    keys:          0 1 2 3 4 5 6 7
    query pos 5:   . . x x x x          keys 2..5
    query pos 6:   . . . x x x x        keys 3..6
    query pos 7:   . . . . x x x x      keys 4..7

Every path applies it: the C++ ``paged_attention`` starts each row at key ``max(0, L -
W)`` (``csrc/paged_attention.cpp``), the PyTorch decode path adds ``-inf`` to the older
slots (``decode_window_bias``) and prefill SDPA takes ``prefill_window_mask`` (segment
repair rows, scattered positions of one sparse sequence: a window per row from its own
position, ``PrefillSeq.mask_for``). Every KV
codec's kernel takes the window (kivi2 included: a row's own block stays exact, its
window's earlier blocks are read from their codes).

Presses (``kv/press/``) compress only the full-attention layers, as kvpress does on Gemma 3;
a window layer keeps the tail of its tokens, so its slots stay consecutive positions
and "the last ``W`` slots" is still its window (``kv/press/compact.py``). A model whose
every layer slides has nothing to press and is refused (``check_window_support``).

Memory: the hybrid KV manager (``kv/hybrid.py``, the default with a window) gives window
layers their own block tables and frees the blocks older than every window (table entry:
the null page, which these paths never read unmasked); ``--disable-hybrid-kv-cache-manager``
keeps one table for all layers, every block allocated until the sequence finishes.
"""

from __future__ import annotations

import torch

from kvstack.core.errors import ConfigError
from kvstack.core.model_config import ModelConfig
from kvstack.kv.press.base import nothing_to_press


def prefill_window_mask(
    q_len: int, ctx_len: int, window: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """``[q_len, ctx_len]`` bool, True = may attend: the causal sliding-window mask of a
    chunk of ``q_len`` queries whose last one sits at position ``ctx_len - 1``, or of
    queries at ``positions`` (segment repair rows, scattered)."""
    pos = (torch.arange(ctx_len - q_len, ctx_len) if positions is None else positions)[:, None]
    keys = torch.arange(ctx_len)[None, :]
    return (keys <= pos) & (keys > pos - window)


def decode_window_bias(bias: torch.Tensor, lens: torch.Tensor, window: int) -> torch.Tensor:
    """The decode bias ``[D, 1, 1, S]`` of rows whose contexts are ``lens`` tokens, with
    ``-inf`` also on the slots older than each row's window (slots ``< len - W``)."""
    slots = torch.arange(bias.shape[-1])[None, :]
    old = (slots < (lens[:, None] - window))[:, None, None, :]
    return bias.masked_fill(old, float("-inf"))


def check_window_support(config: ModelConfig, press: str | None) -> None:
    """``ConfigError`` at startup when ``--kv-press`` cannot run on this model: every layer
    slides a window, so no full-attention layer is left to press. Every codec reads
    windows like ``auto``: the codec kernel starts each row at its window, the PyTorch
    paths mask the older keys."""
    if press is None or not config.has_window:
        return
    why = nothing_to_press(tuple(config.layer_window(i) for i in range(config.num_layers)))
    if why is not None:
        raise ConfigError(
            f"{config.name}: {why} (sliding_window {config.sliding_window}, --kv-press {press})"
        )
