"""Shared checks of kvstack's own bf16 linear kernels (AMX and AVX512-BF16 tests)."""

from __future__ import annotations

import torch


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 product of the same bf16 values."""
    return x.float() @ w.float().T


def assert_rounded_once(y: torch.Tensor, ref: torch.Tensor) -> None:
    """y is ref rounded to bf16, up to float32 summation order: within one bf16 ulp."""
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    ulp = ref.abs().clamp_min(1e-2) * torch.finfo(torch.bfloat16).eps
    assert bool(((y.float() - ref).abs() <= ulp + 1e-4).all())
    assert float((y == ref.bfloat16()).float().mean()) > 0.98  # nearly all exactly rounded
