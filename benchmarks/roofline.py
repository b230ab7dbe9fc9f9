"""Bounds for a decode and a prefill step, measured on this machine (the yardstick
of the step-time goal: a decode step within 2x of its bound, ``docs/performance.md``).

* memory bound  = bytes a step must read ÷ read bandwidth measured over a buffer of that
  many bytes (``torch.sum`` over float32, all threads: larger than the L3 when the step's
  bytes are, so the figure is DRAM's, smaller when the bytes fit in cache);
* compute bound = the step's FLOPs ÷ bf16 GEMM throughput measured with the model's own
  gate_up layer (prepacked oneDNN, the largest GEMM of a layer) at the step's M.

A decode step's bound is ``max(memory, compute)`` at M = batch; a prefill step's is its
compute bound at M = 2048. FLOPs count 2 per multiply-add: every linear layer (the lm_head
only for the rows that sample), and attention (4 · heads · head_dim per query-key pair).
The two measurements live in ``kvstack.tools.profile.bounds`` (``kvstack profile`` uses
them too; each is the best of its timed runs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvstack.tools.profile.bounds import gemm_flops_per_s, read_bandwidth


@dataclass
class ModelSizes:
    layer_params: int  # weights of the per-layer linears, all layers
    head_params: int  # lm_head
    weight_bytes: int  # all linear weights incl. lm_head, as stored
    kv_bytes_per_token: int  # K and V of every layer
    attn_flops_per_pair: int  # per query-key pair, all layers (QK and PV)

    @classmethod
    def of(cls, model: Any) -> ModelSizes:
        cfg = model.config
        lin = [lw for ly in model.layers for lw in (ly.qkv, ly.o, ly.gate_up, ly.down)]
        layer_params = sum(lw.weight.numel() for lw in lin)
        head = model.lm_head.weight
        item = head.element_size()
        return cls(
            layer_params=layer_params,
            head_params=head.numel(),
            weight_bytes=(layer_params + head.numel()) * item,
            kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item,
            attn_flops_per_pair=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim,
        )


@dataclass
class Bound:
    bytes_read: int
    flops: float
    bandwidth_gib_s: float
    gemm_gflops: float
    memory_ms: float
    compute_ms: float

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bound_ms": self.ms}


def decode_bound(model: Any, context_lens: list[int]) -> Bound:
    """Bound of one decode step over requests with these context lengths."""
    s = ModelSizes.of(model)
    b = len(context_lens)
    nbytes = s.weight_bytes + s.kv_bytes_per_token * sum(context_lens)
    flops = 2 * b * (s.layer_params + s.head_params) + s.attn_flops_per_pair * sum(context_lens)
    bw = read_bandwidth(nbytes)
    gemm = gemm_flops_per_s(model.layers[0].gate_up, b, model.dtype)
    return Bound(nbytes, flops, bw / 2**30, gemm / 1e9, 1e3 * nbytes / bw, 1e3 * flops / gemm)


def prefill_bound(model: Any, prompt_lens: list[int]) -> Bound:
    """Compute bound of one prefill step of whole prompts (causal attention, one sampled
    row per prompt), GEMM throughput measured at M = 2048."""
    s = ModelSizes.of(model)
    t = sum(prompt_lens)
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    flops = 2 * t * s.layer_params + 2 * len(prompt_lens) * s.head_params
    flops += s.attn_flops_per_pair * pairs
    gemm = gemm_flops_per_s(model.layers[0].gate_up, 2048, model.dtype)
    nbytes = s.weight_bytes + s.kv_bytes_per_token * t
    return Bound(nbytes, flops, 0.0, gemm / 1e9, 0.0, 1e3 * flops / gemm)
