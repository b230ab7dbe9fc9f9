"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from kvstack.model.kernels.loader import Kernels, load_kernels


@pytest.fixture(scope="session")
def kernels() -> Kernels:
    """``torch.ops.kvstack``, built even when ``KVSTACK_NO_KERNELS`` is set (these tests are
    about the kernels themselves): a failed build fails the test, it is never skipped."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KVSTACK_NO_KERNELS", raising=False)
        built = load_kernels()
    assert built is not None, "the C++ kernels failed to build (see the log warning)"
    return built
