"""KV-cache capacity planner behind ``kvstack plan``: how many requests fit on a GPU set.

Formulas:

* KV bytes per token = layers × 2 (K and V) × kv_heads × head_dim × bytes(kv dtype), the same
  sizing vLLM uses for its paged KV cache (``AttentionSpec.page_size_bytes``). GQA/MQA enter
  through ``kv_heads``.
* MLA (DeepSeek-V2 paper, arXiv:2405.04434 §2.1; DeepSeek-V3, arXiv:2412.19437 §2.1) caches one
  compressed latent of ``kv_lora_rank`` plus the decoupled RoPE key of ``qk_rope_head_dim`` per
  token per layer: no separate K/V, no heads (DeepSeek-V3: 61 × (512 + 64) × 2 B = 70,272 B).
* Sliding-window layers hold at most W tokens: per-request KV = per-layer-token bytes ×
  (full_layers × ctx + window_layers × min(ctx, W)).
* Tensor parallelism (vLLM's rule): each GPU holds kv_heads / tp heads when kv_heads ≥ tp, else one
  replicated head; the MLA latent is replicated on every GPU. Weights are split evenly.
* Reserve per GPU for activations, CUDA graphs and the allocator: max(1 GiB, 5 % of GPU memory).
* KV budget per GPU = memory × utilization − params × bytes(weights dtype) / tp − reserve (vLLM's
  ``gpu_memory_utilization`` accounting: the fraction covers weights, activations and KV).
* Requests that fit = floor(budget / per-request KV), both per GPU.
* Prefix hit rate h: a fraction h of every request's tokens is a shared, cached prefix stored
  once, so N requests need h·R + N·(1−h)·R ≤ budget, i.e. N = floor((budget − h·R) / ((1−h)·R)).
* Autoscaling: scale out when ``kvstack:kv_cache_usage_perc`` exceeds the level at which one more
  max-context request no longer fits, 1 − R / budget, clamped to [0.5, 0.9].

GPU memory follows the data file's convention: a vendor's "80GB" is 80 GiB (80 × 2^30 bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvstack.config import parse_size
from kvstack.errors import ConfigError

GB = 10**9
GiB = 2**30
MiB = 2**20
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5,
}  # fmt: skip
RESERVE_MIN_BYTES = GiB
RESERVE_FRACTION = 0.05
THRESHOLD_RANGE = (0.5, 0.9)
_HF_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes that decide KV and weight memory."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    max_position_embeddings: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    weights_dtype: str = "bf16"
    params_estimated: bool = False

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None


@dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    memory_bytes: int


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
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def parse_tokens(text: str | int) -> int:
    """``128k`` → 131072 (k = 1024, m = 1024²), or a plain positive integer."""
    s = str(text).strip().lower()
    scale = {"k": 1024, "m": 1024**2}.get(s[-1:], 1)
    try:
        value = int(s[:-1] if scale > 1 else s) * scale
    except ValueError:
        raise ConfigError(f"cannot parse token count {text!r} (examples: 131072, 128k)") from None
    if value <= 0:
        raise ConfigError(f"context must be positive, got {text!r}")
    return value


def _load(name: str) -> dict[str, Any]:
    text = resources.files("kvstack.tools").joinpath("data", name).read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def known_models() -> dict[str, dict[str, Any]]:
    return _load("models.json")


def known_gpus() -> dict[str, dict[str, Any]]:
    return _load("gpus.json")


def _dtype(name: str, what: str) -> str:
    d = name.lower()
    if d not in DTYPE_BYTES:
        raise ConfigError(f"unknown {what} {name!r}; choose from {', '.join(DTYPE_BYTES)}")
    return d


def _positive(value: int | float, what: str) -> None:
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {value}")


_REGISTRY_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
    "num_params", "max_position_embeddings",
)  # fmt: skip


def resolve_model(text: str) -> ModelSpec:
    """A registry name (or its Hugging Face id), a config.json path, or a folder holding one."""
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read model config {str(path)!r}: {e}") from None
        return model_from_hf_config(cfg, str(path))
    reg = known_models()
    for key, entry in reg.items():
        if text.lower() in (key, str(entry.get("hf_id", "")).lower()):
            mla = entry.get("mla") or {}
            window = entry.get("sliding_window")
            return ModelSpec(
                name=key,
                **{f: entry[f] for f in _REGISTRY_FIELDS},
                kv_lora_rank=mla.get("kv_lora_rank"),
                qk_rope_head_dim=mla.get("qk_rope_head_dim"),
                sliding_window=window,
                num_sliding_layers=entry.get("num_sliding_layers", entry["num_layers"])
                if window
                else 0,
                weights_dtype=entry.get("weights_dtype", "bf16"),
            )
    if text.endswith(".json") or "/" in text:
        raise ConfigError(f"model config not found: {text!r}; known models: {', '.join(reg)}")
    raise ConfigError(f"unknown model {text!r}; known models: {', '.join(reg)} (or a config.json)")


def _need(cfg: dict[str, Any], key: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"{source}: missing field {key!r} needed by the planner")
    return cfg[key]


def model_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Read a Hugging Face ``config.json`` (text-model fields; ``text_config`` if nested)."""
    cfg = cfg.get("text_config") or cfg
    layers = int(_need(cfg, "num_hidden_layers", source))
    hidden = int(_need(cfg, "hidden_size", source))
    heads = int(_need(cfg, "num_attention_heads", source))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    max_pos = int(_need(cfg, "max_position_embeddings", source))
    for what, v in (("num_hidden_layers", layers), ("hidden_size", hidden), ("heads", heads)):
        _positive(v, f"{source}: {what}")
    mla = cfg.get("kv_lora_rank") is not None
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    n_sliding = 0
    if window:
        if isinstance(cfg.get("layer_types"), list):
            n_sliding = sum(t == "sliding_attention" for t in cfg["layer_types"])
        elif cfg.get("sliding_window_pattern"):  # Gemma-3: every Nth layer is global
            n_sliding = layers - layers // int(cfg["sliding_window_pattern"])
        else:  # Mistral semantics: every layer slides
            n_sliding = layers
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    wdtype = "fp8" if quant == "fp8" else _HF_DTYPES.get(str(cfg.get("torch_dtype")), "bf16")
    params = cfg.get("num_params")
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or source),
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_params=int(params) if params else estimate_params(cfg, source),
        max_position_embeddings=max_pos,
        kv_lora_rank=int(_need(cfg, "kv_lora_rank", source)) if mla else None,
        qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim", source)) if mla else None,
        sliding_window=int(window) if window and n_sliding else None,
        num_sliding_layers=n_sliding,
        weights_dtype=wdtype,
        params_estimated=not params,
    )


def estimate_params(cfg: dict[str, Any], source: str = "config.json") -> int:
    """Parameter count from a decoder's shapes (norms and biases ignored, < 0.1 %).

    Embeddings vocab × hidden (twice unless ``tie_word_embeddings``); attention Q, K, V, O (MLA:
    the low-rank q_a/q_b, kv_a/kv_b and O projections of DeepSeek-V2 §2.1); a gated MLP of
    3 × hidden × intermediate, or for MoE (``num_local_experts`` / ``n_routed_experts`` plus
    ``n_shared_experts``, after ``first_k_dense_replace`` dense layers) that many expert MLPs of
    ``moe_intermediate_size`` plus the router.
    """
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    vocab = int(_need(cfg, "vocab_size", source))
    inter = int(_need(cfg, "intermediate_size", source))
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    if cfg.get("kv_lora_rank") is not None:
        rope, nope = int(cfg["qk_rope_head_dim"]), int(_need(cfg, "qk_nope_head_dim", source))
        v_hd, kv_r = int(_need(cfg, "v_head_dim", source)), int(cfg["kv_lora_rank"])
        q_r = cfg.get("q_lora_rank")
        q = h * heads * (nope + rope) if not q_r else h * q_r + q_r * heads * (nope + rope)
        attn = q + h * (kv_r + rope) + kv_r * heads * (nope + v_hd) + heads * v_hd * h
    else:
        attn = 2 * h * heads * hd + 2 * h * kv_heads * hd
    experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
    dense_mlp = 3 * h * inter
    if experts:
        moe_inter = int(cfg.get("moe_intermediate_size") or inter)
        shared = int(cfg.get("n_shared_experts") or 0)
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        moe_mlp = (experts + shared) * 3 * h * moe_inter + h * experts
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp_total = layers * dense_mlp
    return embed + layers * attn + mlp_total


def resolve_gpu(text: str) -> GpuSpec:
    """A registry name (``h100-80gb``) or a per-GPU memory size (``80GiB``, ``141GB``)."""
    reg = known_gpus()
    if text.lower() in reg:
        entry = reg[text.lower()]
        return GpuSpec(text.lower(), entry["name"], int(entry["memory_bytes"]))
    if text[:1].isdigit() or text[:1] == "-":
        try:
            size = parse_size(text)
        except ConfigError as e:
            raise ConfigError(f"bad --gpu {text!r}: {e}") from None
        return GpuSpec(text, f"custom {text}", size)
    raise ConfigError(f"unknown GPU {text!r}; known GPUs: {', '.join(reg)} (or a size like 80GiB)")


def make_plan(
    model: ModelSpec,
    gpu: GpuSpec,
    context: int,
    kv_cache_dtype: str = "bf16",
    weights_dtype: str | None = None,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    prefix_hit_rate: float = 0.0,
) -> Plan:
    """Compute every figure of the plan (see the module docstring for the formulas)."""
    kv_dtype = _dtype(kv_cache_dtype, "--kv-cache-dtype")
    w_dtype = _dtype(weights_dtype or model.weights_dtype, "--weights-dtype")
    _positive(context, "context")
    _positive(tp, "--tp")
    _positive(gpu.memory_bytes, "GPU memory")
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
    layer_tokens = n_full * context + n_win * min(context, w)
    if n_win:
        rate = f"the {n_full} full-attention layers" if n_full else "all layers, up to the window"
        notes.append(
            f"{n_win} of {model.num_layers} layers use a {w:,}-token sliding window and hold "
            f"at most {w:,} tokens; the per-token figure counts {rate}"
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
        notes=notes,
        warnings=warnings,
    )


def fmt_bytes(n: int) -> str:
    """``47,244,640,256 B (47.24 GB / 44.00 GiB)``; under 1 MiB in MiB."""
    if abs(n) < MiB:
        return f"{n:,} B ({n / MiB:.3f} MiB)"
    return f"{n:,} B ({n / GB:.2f} GB / {n / GiB:.2f} GiB)"


def format_plan(p: Plan) -> str:
    tp_s = f" × {p.tp}" if p.tp > 1 else ""
    rows = [
        ("model", f"{p.model} — {p.attention}"),
        ("gpu", f"{p.gpu}{tp_s}, {fmt_bytes(p.gpu_memory_bytes)} each, util "
         f"{p.gpu_memory_utilization:g}"),
        ("context", f"{p.context:,} tokens (model max {p.max_position_embeddings:,})"
         + ("  [OVER THE MODEL'S LIMIT]" if p.context > p.max_position_embeddings else "")),
        ("dtypes", f"KV {p.kv_cache_dtype}, weights {p.weights_dtype}"),
        ("KV per token", fmt_bytes(p.kv_bytes_per_token)),
        ("KV per request", fmt_bytes(p.kv_bytes_per_request)),
    ]  # fmt: skip
    if p.tp > 1:
        heads = f", {p.kv_heads_per_gpu} KV head(s)" if p.kv_heads_per_gpu else ""
        rows += [
            ("  per GPU/token", fmt_bytes(p.kv_bytes_per_token_per_gpu) + heads),
            ("  per GPU/request", fmt_bytes(p.kv_bytes_per_request_per_gpu)),
        ]
    est = " (estimated params)" if p.params_estimated else ""
    rows += [
        ("weights / GPU", fmt_bytes(p.weights_bytes_per_gpu) + est),
        ("reserve / GPU", fmt_bytes(p.reserve_bytes_per_gpu) + " = max(1 GiB, 5% of memory)"),
        ("KV budget / GPU", fmt_bytes(p.kv_budget_bytes_per_gpu)),
        ("KV budget total", fmt_bytes(p.kv_budget_bytes_total)),
        ("requests that fit", f"{p.max_concurrent_requests} at {p.context:,} tokens"),
    ]
    if p.prefix_hit_rate:
        rows.append((f"  with {p.prefix_hit_rate:g} hit", str(p.effective_concurrent_requests)))
    th = p.autoscale_kv_usage_threshold
    rows.append(("scale out when", f"kvstack:kv_cache_usage_perc > {th:.2f}" if th else "n/a"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"note: {n}" for n in p.notes] + [f"WARNING: {w}" for w in p.warnings]
    return "\n".join(lines)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """Options of ``kvstack plan``."""
    p.add_argument("--model", required=True, help="registry name, HF id, or path to config.json")
    p.add_argument(
        "--gpu",
        required=True,
        help="GPU name or per-GPU memory such as 80GiB; a name's '80gb' means 80 GiB (80 × 2^30 B)",
    )
    p.add_argument("--context", required=True, help="tokens per request: 131072 or 128k (k=1024)")
    p.add_argument("--kv-cache-dtype", default="bf16", choices=[*DTYPE_BYTES], help="default bf16")
    p.add_argument(
        "--weights-dtype", choices=[*DTYPE_BYTES], help="default: the checkpoint's dtype"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="(0, 1], default 0.9")
    p.add_argument(
        "--prefix-hit-rate",
        type=float,
        default=0.0,
        help="fraction of each request's tokens that is a shared cached prefix, in [0, 1)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON object with every figure")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``kvstack plan``; raises ConfigError on bad input, warnings go to stderr."""
    plan = make_plan(
        resolve_model(args.model),
        resolve_gpu(args.gpu),
        parse_tokens(args.context),
        kv_cache_dtype=args.kv_cache_dtype,
        weights_dtype=args.weights_dtype,
        tp=args.tp,
        gpu_memory_utilization=args.gpu_memory_utilization,
        prefix_hit_rate=args.prefix_hit_rate,
    )
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0
