"""The fused C++ ops (``csrc/fused_ops.cpp``) against the PyTorch reference (``TorchOps``):
bf16 and fp32, widths that leave a scalar tail after the 16-lane loop, shuffled slots that
cross block boundaries, bad positions and slots refused before anything is written, and
fallbacks counted."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from kvstack.engine.stats import EngineStats
from kvstack.kv.base import KVCacheStats
from kvstack.kv.storage import KVStorage
from kvstack.model.arch.layers import Rotary
from kvstack.model.arch.ops import HeadShape, KernelOps, TorchOps
from kvstack.model.kernels import loader as kernels_mod
from kvstack.model.kernels.loader import Kernels, load_kernels
from kvstack.serve.metrics.server import ServerMetrics
from kvstack.testing.tiny_models import tiny_llama_config

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kops(kernels: Kernels) -> KernelOps:
    return KernelOps(kernels)


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's epsilon at each element's magnitude."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-3)
    return float(((a.float() - b.float()).abs() / (scale * eps)).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 40, 7])
def test_norms_match_reference(kops: KernelOps, dtype: torch.dtype, width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=g).to(dtype)
    r = torch.randn(5, width, generator=g).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    ref = TorchOps()
    assert ulps(kops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)) <= 4
    want_x, want_r = ref.add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    got_x, got_r = kops.add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(got_r, want_r)  # the residual add rounds exactly as PyTorch's add
    assert ulps(got_x, want_x) <= 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 24])
def test_silu_and_mul_matches_reference(kops: KernelOps, dtype: torch.dtype, width: int) -> None:
    g = torch.Generator().manual_seed(1)
    gu = (4 * torch.randn(3, 2 * width, generator=g)).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp under/overflow
    got, want = kops.silu_and_mul(gu), TorchOps().silu_and_mul(gu)
    assert got.dtype == dtype and got.shape == (3, width)
    assert ulps(got, want) <= 2
    nan = gu.clone()
    nan[1, 0] = nan[2, width] = float("nan")  # a NaN gate, a NaN up: NaN out, as PyTorch
    got, want = kops.silu_and_mul(nan), TorchOps().silu_and_mul(nan)
    assert torch.equal(got.isnan(), want.isnan()) and got[1, 0].isnan() and got[2, 0].isnan()


def _storage(dtype: torch.dtype, heads: HeadShape, codec: str = "auto") -> KVStorage:
    cfg = tiny_llama_config(
        num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads, head_dim=heads.head_dim
    )
    return KVStorage(cfg, num_blocks=6, block_size=4, dtype=dtype, codec=codec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rope_and_cache_bit_exact(kops: KernelOps, dtype: torch.dtype, head_dim: int) -> None:
    """q, k, v and the cache equal the reference bit for bit (rounding where PyTorch does)."""
    heads = HeadShape(num_heads=6, num_kv_heads=2, head_dim=head_dim)
    rot = Rotary(head_dim, 64, 10000.0, None)
    g = torch.Generator().manual_seed(head_dim)
    t = 9
    qkv = torch.randn(t, (6 + 2 * 2) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 40, 41, 63])
    slots = torch.tensor([13, 14, 15, 16, 17, 2, 22, 23, 0])  # crosses blocks 3 -> 4
    outs = []
    for ops in (TorchOps(), kops):
        kv = _storage(dtype, heads)
        q, k, v = ops.rope_and_cache(
            qkv.clone(), ops.rope_input(rot, positions, dtype), heads, kv.layer(0), slots
        )
        outs.append((q, k, v, kv.k.clone(), kv.v.clone()))
    for want, got in zip(*outs, strict=True):
        assert torch.equal(want, got)


def test_rope_and_cache_refuses_bad_slots_and_positions(kops: KernelOps) -> None:
    heads = HeadShape(4, 2, 64)
    rot = Rotary(64, 16, 10000.0, None)
    kv = _storage(torch.float32, heads)
    qkv = torch.randn(3, 8 * 64)
    before = qkv.clone()
    rope = kops.rope_input(rot, torch.tensor([0, 1, 2]), torch.float32)
    with pytest.raises(RuntimeError, match="KV slot 24 outside"):
        kops.rope_and_cache(qkv, rope, heads, kv.layer(0), torch.tensor([0, 1, 24]))
    with pytest.raises(RuntimeError, match="position 16 outside"):
        bad = kops.rope_input(rot, torch.tensor([0, 16, 2]), torch.float32)
        kops.rope_and_cache(qkv, bad, heads, kv.layer(0), torch.tensor([0, 1, 2]))
    assert torch.equal(qkv, before) and not kv.k.any()  # nothing written


@pytest.mark.parametrize("codec,counted", [("int8", False), ("kivi2", False), ("bf16", True)])
def test_encoded_cache_write(kops: KernelOps, codec: str, counted: bool) -> None:
    """An encoded cache is written after the fused RoPE with the same result as the
    reference ops: a per-token codec (int8) by the C++ ``codec_write``, kivi2 by
    ``kivi2_write``, neither counted; a cast cache (bf16 under a float32 model) through
    its PyTorch ``write``, counted as the ``kv_cache_write`` fallback."""
    heads = HeadShape(4, 2, 64)
    rot = Rotary(64, 16, 10000.0, None)
    before = kernels_mod.fallback_counts().get(("kv_cache_write", "encoded_cache"), 0)
    outs = []
    for ops in (TorchOps(), kops):
        kv = _storage(torch.float32, heads, codec=codec)
        qkv = torch.randn(3, 8 * 64, generator=torch.Generator().manual_seed(3))
        rope = ops.rope_input(rot, torch.tensor([0, 1, 2]), torch.float32)
        ops.rope_and_cache(qkv, rope, heads, kv.layer(0), torch.tensor([4, 5, 6]))
        outs.append(kv.layer(0).gather(torch.tensor([1])))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    after = kernels_mod.fallback_counts().get(("kv_cache_write", "encoded_cache"), 0)
    assert after == before + counted


def test_fallback_is_counted_and_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSTACK_NO_KERNELS: load_kernels returns None and counts it; the engine's stats carry
    the counts that /metrics exports as kvstack:kernel_fallback_total."""
    monkeypatch.setenv("KVSTACK_NO_KERNELS", "1")
    before = kernels_mod.fallback_counts().get(("all", "disabled"), 0)
    assert load_kernels() is None
    assert kernels_mod.fallback_counts()[("all", "disabled")] == before + 1
    metrics = ServerMetrics("m")
    metrics.update_engine(
        _zeros(EngineStats, kernel_fallbacks=[["all", "disabled", 3]]), _zeros(KVCacheStats)
    )
    text = generate_latest(metrics.registry).decode()
    want = 'kvstack:kernel_fallback_total{kernel="all",model_name="m",reason="disabled"} 3.0'
    assert want in text


def _zeros(cls: type, **values: object) -> Any:
    """An instance of dataclass ``cls`` with every required field 0 (then ``values``)."""
    required = {
        f.name: 0 for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    }
    return cls(**{**required, **values})
