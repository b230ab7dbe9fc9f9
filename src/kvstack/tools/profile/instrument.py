"""Operator timers installed on a live model: time, FLOPs and bytes of every call.

``Instrument(engine)`` wraps, for as long as it is active, the model's linears
(``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``), its layer ops (``norm``:
RMSNorm and residual add + RMSNorm; ``rope_kv_write``: RoPE and the KV write through the
codec; ``silu_mul``) and attention (``model.llama.paged_attention``), so a real engine
step is measured operator by operator (OpScale's operator-level view, on this engine's
own operators). Each call adds its wall time (``time.perf_counter``; CPU ops are
synchronous) and its FLOPs and bytes, counted from the call's own shapes:

==============  =====================================  ====================================
operator        FLOPs                                  bytes moved (each operand once)
==============  =====================================  ====================================
linear (M x K   2 M K N                                weights as stored + M (K + N) x act
-> N)
attention       4 H d x (query-key pairs)               KV each sequence reads (codec bytes
                                                       per token) + 2 T H d x act (q, out)
rope_kv_write   3 (H + KVH) d M (the rotation)          read + write qkv + the KV written
norm            4 x elements (5 with the residual add)  read + write the activations
silu_mul        5 M I                                  M 3 I x act
==============  =====================================  ====================================

``act`` is the activation itemsize. Not counted: the embedding lookup, sampling, the
runner's input tensors and Python (the step's wall time minus its operators: ``other``),
the codecs' quantization arithmetic in the KV write, re-reads that the hardware serves
from cache (the bytes are the minimum traffic, so achieved bandwidth is a lower bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import kvstack.model.arch.decoder as llama_mod
from kvstack.model.attention import AttentionMetadata
from kvstack.model.quant.linear import QuantLinear, StackedLinear

LINEARS = ("qkv", "o", "gate_up", "down")


@dataclass
class OpStat:
    """One operator's totals over the measured steps of one phase."""

    calls: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0


class Recorder:
    """Totals per (phase, operator); ``phase`` None means calls are not recorded."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.stats: dict[tuple[str, str], OpStat] = {}

    def add(self, name: str, seconds: float, flops: float, nbytes: float) -> None:
        if self.phase is None:
            return
        st = self.stats.setdefault((self.phase, name), OpStat())
        st.calls += 1
        st.seconds += seconds
        st.flops += flops
        st.bytes += nbytes


class TimedLinear:
    """A linear layer that reports each call to a ``Recorder``."""

    def __init__(self, inner: Any, name: str, rec: Recorder) -> None:
        self.inner, self.name, self.rec = inner, name, rec
        # A quantized linear (--quantization) reads its packed codes. (A dense ``Linear``
        # has a ``packed`` too where oneDNN has native bf16: its reordered weight tensor.)
        if isinstance(inner, QuantLinear | StackedLinear):
            self.out_f = int(inner.out_features)
            self.in_f = int(inner.in_features)
            self.weight_bytes = int(inner.decode_bytes)
        else:
            w = inner.weight
            self.out_f, self.in_f = int(w.shape[0]), int(w.shape[1])
            self.weight_bytes = w.numel() * w.element_size()

    def __getattr__(self, attr: str) -> Any:  # .weight, .out_features ... of the layer
        if attr == "inner":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.inner(x)
        dt = time.perf_counter() - t0
        m = x.shape[0]
        act = (m * (self.in_f + self.out_f)) * x.element_size()
        self.rec.add(self.name, dt, 2.0 * m * self.in_f * self.out_f, self.weight_bytes + act)
        return y


def attention_cost(
    q: torch.Tensor, meta: AttentionMetadata, kv_bytes_per_token: float
) -> tuple[float, float]:
    """(FLOPs, bytes) of one layer's attention call: ``4 H d`` per query-key pair; the KV
    of each sequence read once (``kv_bytes_per_token``: this layer, all KV heads)."""
    pairs, kv_tokens = 0, 0
    rows = meta.kernel_rows
    if rows is not None:
        lens = rows.context_lens.tolist()
        pairs += sum(lens)
        if rows.table_index is None:
            kv_tokens += sum(lens)
        else:  # rows of one chunk share a table: its longest context is read once
            longest: dict[int, int] = {}
            for t, n in zip(rows.table_index.tolist(), lens, strict=True):
                longest[t] = max(longest.get(t, 0), n)
            kv_tokens += sum(longest.values())
    elif meta.decode_context_lens is not None:
        lens = meta.decode_context_lens.tolist()
        pairs += sum(lens)
        kv_tokens += sum(lens)
    for p in meta.prefills:  # query i of a chunk of q ending at ctx sees ctx - q + i + 1
        per_seq = p.q_len * (p.ctx_len - p.q_len) + p.q_len * (p.q_len + 1) // 2
        pairs += p.num_seqs * per_seq
        kv_tokens += p.num_seqs * p.ctx_len
    t, h, d = q.shape
    flops = 4.0 * h * d * pairs
    return flops, kv_tokens * kv_bytes_per_token + 2.0 * t * h * d * q.element_size()


def _timed(rec: Recorder, name: str, fn: Callable[..., Any], cost: Callable[..., Any]) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        flops, nbytes = cost(*args, **kwargs)
        rec.add(name, dt, flops, nbytes)
        return out

    return wrapper


def _norm_cost(x: torch.Tensor, *rest: Any, **kw: Any) -> tuple[float, float]:
    return 4.0 * x.numel(), 2.0 * x.numel() * x.element_size()


def _add_norm_cost(h: torch.Tensor, *rest: Any, **kw: Any) -> tuple[float, float]:
    return 5.0 * h.numel(), 4.0 * h.numel() * h.element_size()


def _silu_cost(gu: torch.Tensor, **kw: Any) -> tuple[float, float]:
    return 2.5 * gu.numel(), 1.5 * gu.numel() * gu.element_size()


@contextmanager
def instrument(engine: Any, rec: Recorder) -> Iterator[None]:
    """Install the timers on ``engine``'s model for the ``with`` block, then restore it."""
    model = engine.model
    cfg = model.config
    storage = engine.kv_storage
    item = torch.empty((), dtype=model.dtype).element_size()
    per_head = type(storage.codec).bytes_per_token_head(cfg.head_dim, storage.block_size, item)
    kv_layer_token = per_head * cfg.num_kv_heads  # one layer's K+V bytes of one token
    rot_elems = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim

    def rope_cost(qkv: torch.Tensor, *rest: Any, **kw: Any) -> tuple[float, float]:
        m = qkv.shape[0]
        return 3.0 * rot_elems * m, 2.0 * qkv.numel() * item + m * kv_layer_token

    ops = model.ops
    saved_layers = [{n: getattr(ly, n) for n in LINEARS} for ly in model.layers]
    saved_head, saved_attn = model.lm_head, llama_mod.paged_attention
    names = ("rms_norm", "add_rms_norm", "rope_and_cache", "silu_and_mul")
    saved_ops = {n: getattr(ops, n) for n in names}
    attn = saved_attn
    saved_stack, model.stack = model.stack, None  # time the layers op by op, not in one call
    try:
        for ly in model.layers:
            for n in LINEARS:
                setattr(ly, n, TimedLinear(getattr(ly, n), n, rec))
        setattr(model, "lm_head", TimedLinear(saved_head, "lm_head", rec))  # noqa: B010
        costs = {
            "rms_norm": ("norm", _norm_cost),
            "add_rms_norm": ("norm", _add_norm_cost),
            "rope_and_cache": ("rope_kv_write", rope_cost),
            "silu_and_mul": ("silu_mul", _silu_cost),
        }
        for n, (label, cost) in costs.items():  # instance attributes shadow the methods
            setattr(ops, n, _timed(rec, label, saved_ops[n], cost))
        timed_attn = _timed(
            rec,
            "attention",
            attn,
            lambda q, k, v, cache, meta, scale, *a, **kw: attention_cost(q, meta, kv_layer_token),
        )
        setattr(llama_mod, "paged_attention", timed_attn)  # noqa: B010
        yield
    finally:
        for ly, saved in zip(model.layers, saved_layers, strict=True):
            for n, lin in saved.items():
                setattr(ly, n, lin)
        setattr(model, "lm_head", saved_head)  # noqa: B010
        model.stack = saved_stack
        for n in names:
            try:
                delattr(ops, n)  # the instance attribute that shadowed the method
            except AttributeError:
                setattr(ops, n, saved_ops[n])
        setattr(llama_mod, "paged_attention", saved_attn)  # noqa: B010
