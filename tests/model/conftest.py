"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from kvstack.model.kernels.loader import Kernels, kernel_state, load_kernels


@pytest.fixture(scope="session")
def kernels() -> Kernels:
    """``torch.ops.kvstack``, loaded even when ``KVSTACK_NO_KERNELS`` is set (these tests are
    about the kernels themselves): kernels that are missing, stale or fail to load fail the
    test, it is never skipped (``make test`` builds them first: ``make kernels``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVSTACK_NO_KERNELS", raising=False)
        built = load_kernels()
    assert built is not None, f"C++ kernels not loaded ({kernel_state()}): run `make kernels`"
    return built
