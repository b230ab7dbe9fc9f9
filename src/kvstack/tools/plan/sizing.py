"""The arithmetic of ``kvstack plan``: how many requests fit on a GPU set (:func:`make_plan`).

Formulas:

* KV bytes per token = layers × 2 (K and V) × kv_heads × head_dim × bytes(kv dtype), the same
  sizing vLLM uses for its paged KV cache (``AttentionSpec.page_size_bytes``). GQA/MQA enter
  through ``kv_heads``.
* MLA (DeepSeek-V2 paper, arXiv:2405.04434 §2.1; DeepSeek-V3, arXiv:2412.19437 §2.1) caches one
  compressed latent of ``kv_lora_rank`` plus the decoupled RoPE key of ``qk_rope_head_dim`` per
  token per layer: no separate K/V, no heads (DeepSeek-V3: 61 × (512 + 64) × 2 B = 70,272 B).
* Tokens are held in whole blocks of ``block_size`` (kvstack's and vLLM's paged cache;
  default 16), and sliding-window layers hold only the blocks their next row can read, as
  kvstack's hybrid KV manager frees them (``kv.groups.blocks_held``, the engine's own
  count): per-request KV = per-layer-token bytes × block_size × (full_layers ×
  ceil(ctx / bs) + window_layers × (ceil(ctx / bs) − floor((ctx − W + 1) / bs))), i.e.
  ≈ full_layers × ctx + window_layers × min(ctx, W), at most ``block_size − 1`` tokens
  more per layer. (A long prefill holds up to W − 1 + one chunk per window layer.)
* Tensor parallelism (vLLM's rule): each GPU holds kv_heads / tp heads when kv_heads ≥ tp, else one
  replicated head; the MLA latent is replicated on every GPU. Weights are split evenly.
* Reserve per GPU for activations, CUDA graphs and the allocator: max(1 GiB, 5 % of GPU memory).
* KV budget per GPU = memory × utilization − params × bytes(weights dtype) / tp − reserve (vLLM's
  ``gpu_memory_utilization`` accounting: the fraction covers weights, activations and KV).
* Requests that fit = floor(budget / per-request KV), both per GPU.
* Prefix hit rate h: a fraction h of every request's tokens is a shared, cached prefix stored
  once, so N requests need h·R + N·(1−h)·R ≤ budget, i.e. N = floor((budget − h·R) / ((1−h)·R)).
* Autoscaling: scale out when ``vllm:kv_cache_usage_perc`` exceeds the level at which one more
  max-context request no longer fits, 1 − R / budget, clamped to [0.5, 0.9].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstack.core.errors import ConfigError
from kvstack.kv.groups import blocks_held
from kvstack.tools.plan.specs import (
    DTYPE_BYTES,
    GiB,
    GpuSpec,
    ModelSpec,
    check_dtype,
    check_positive,
)

RESERVE_MIN_BYTES = GiB
RESERVE_FRACTION = 0.05
THRESHOLD_RANGE = (0.5, 0.9)


@dataclass
class Plan:
    """Every figure ``kvstack plan`` prints; byte counts are per GPU unless named ``total``."""

    model: str
    gpu: str
    gpu_memory_bytes: int
    tp: int
    context: int
    kv_cache_dtype: str
    weights_dtype: str
    gpu_memory_utilization: float
    prefix_hit_rate: float
    attention: str
    kv_heads_per_gpu: int | None
    kv_bytes_per_token: int  # whole model, one copy, full-attention layers' rate
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_request: int  # whole model, one copy
    kv_bytes_per_request_per_gpu: int
    weights_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    kv_budget_bytes_total: int
    max_concurrent_requests: int
    effective_concurrent_requests: int
    autoscale_kv_usage_threshold: float | None
    max_position_embeddings: int
    params_estimated: bool
    block_size: int = 16  # requests hold whole blocks of this many tokens
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def make_plan(
    model: ModelSpec,
    gpu: GpuSpec,
    context: int,
    kv_cache_dtype: str = "bf16",
    weights_dtype: str | None = None,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    prefix_hit_rate: float = 0.0,
    block_size: int = 16,
) -> Plan:
    """Compute every figure of the plan (see the module docstring for the formulas)."""
    kv_dtype = check_dtype(kv_cache_dtype, "--kv-cache-dtype")
    w_dtype = check_dtype(weights_dtype or model.weights_dtype, "--weights-dtype")
    check_positive(context, "context")
    check_positive(tp, "--tp")
    check_positive(block_size, "--block-size")
    check_positive(gpu.memory_bytes, "GPU memory")
    util = gpu_memory_utilization
    if not 0 < util <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if not 0 <= prefix_hit_rate < 1:
        raise ConfigError(f"--prefix-hit-rate must be in [0, 1), got {prefix_hit_rate}")
    notes: list[str] = []
    warnings: list[str] = []
    b = DTYPE_BYTES[kv_dtype]
    if model.is_mla:
        assert model.qk_rope_head_dim is not None and model.kv_lora_rank is not None
        elems = model.kv_lora_rank + model.qk_rope_head_dim
        layer_tok, layer_tok_gpu, heads_gpu = elems * b, elems * b, None
        attention = f"MLA (latent {model.kv_lora_rank} + rope {model.qk_rope_head_dim})"
        if tp > 1:
            notes.append("MLA latent is not split by TP: every GPU holds a full copy")
    else:
        heads_gpu = math.ceil(model.num_kv_heads / tp) if model.num_kv_heads >= tp else 1
        layer_tok = 2 * model.num_kv_heads * model.head_dim * b
        layer_tok_gpu = 2 * heads_gpu * model.head_dim * b
        kind = "MHA" if model.num_kv_heads == model.num_attention_heads else "GQA"
        attention = f"{kind} ({model.num_kv_heads} KV heads × {model.head_dim})"
        if model.num_kv_heads < tp:
            notes.append(f"{model.num_kv_heads} KV heads < tp={tp}: KV heads replicated per GPU")
        elif model.num_kv_heads % tp:
            notes.append(f"{model.num_kv_heads} KV heads not divisible by tp={tp}: rounded up")
    n_win = model.num_sliding_layers
    n_full = model.num_layers - n_win
    w = model.sliding_window or 0
    layer_tokens = block_size * (
        n_full * blocks_held(context, None, block_size)
        + n_win * blocks_held(context, w or None, block_size)
    )
    if n_win:
        rate = f"the {n_full} full-attention layers" if n_full else "all layers, up to the window"
        held = block_size * blocks_held(context, w, block_size)
        notes.append(
            f"{n_win} of {model.num_layers} layers use a {w:,}-token sliding window and hold "
            f"{held:,} tokens at this context (whole {block_size}-token blocks, as kvstack's "
            f"hybrid KV manager frees them; up to W - 1 + one chunk during a long prefill); "
            f"the per-token figure counts {rate}"
        )
    per_tok_layers = n_full or model.num_layers
    over = context > model.max_position_embeddings
    if over:
        warnings.append(
            f"context {context:,} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings:,}; figures computed anyway"
        )
    per_req = math.ceil(layer_tok * layer_tokens)
    per_req_gpu = math.ceil(layer_tok_gpu * layer_tokens)
    mem = gpu.memory_bytes
    weights = math.ceil(model.num_params * DTYPE_BYTES[w_dtype] / tp)
    reserve = max(RESERVE_MIN_BYTES, math.ceil(RESERVE_FRACTION * mem))
    budget = math.floor(mem * util) - weights - reserve
    if budget <= 0:
        warnings.append("weights and reserve exceed the usable memory: no room for KV cache")
    fits = max(0, budget // per_req_gpu)
    h = prefix_hit_rate
    shared = h * per_req_gpu
    eff = math.floor((budget - shared) / ((1 - h) * per_req_gpu) + 1e-9) if budget >= shared else 0
    threshold: float | None = None
    if fits >= 1:
        lo, hi = THRESHOLD_RANGE
        threshold = round(min(hi, max(lo, 1 - per_req_gpu / budget)), 4)
    else:
        notes.append("no max-context request fits: no autoscaling threshold")
    if model.params_estimated:
        notes.append("parameter count estimated from the config's shapes")
    return Plan(
        model=model.name,
        gpu=gpu.key,
        gpu_memory_bytes=mem,
        tp=tp,
        context=context,
        kv_cache_dtype=kv_dtype,
        weights_dtype=w_dtype,
        gpu_memory_utilization=util,
        prefix_hit_rate=h,
        attention=attention,
        kv_heads_per_gpu=heads_gpu,
        kv_bytes_per_token=math.ceil(layer_tok * per_tok_layers),
        kv_bytes_per_token_per_gpu=math.ceil(layer_tok_gpu * per_tok_layers),
        kv_bytes_per_request=per_req,
        kv_bytes_per_request_per_gpu=per_req_gpu,
        weights_bytes_per_gpu=weights,
        reserve_bytes_per_gpu=reserve,
        kv_budget_bytes_per_gpu=budget,
        kv_budget_bytes_total=budget * tp,
        max_concurrent_requests=int(fits),
        effective_concurrent_requests=max(0, eff),
        autoscale_kv_usage_threshold=threshold,
        max_position_embeddings=model.max_position_embeddings,
        params_estimated=model.params_estimated,
        block_size=block_size,
        notes=notes,
        warnings=warnings,
    )
