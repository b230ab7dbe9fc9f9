"""Builds kvstack's C++ kernels at install (metadata lives in pyproject.toml).

``pip install --no-build-isolation [-e] .`` (``make setup``) runs ``build_ext``, which
compiles one library per ISA level with ninja (``src/kvstack/model/kernels/build.py``):
those this CPU runs, or every level with ``KVSTACK_BUILD_ALL_ISA=1`` (``pip wheel``).
``--no-build-isolation`` because the kernels link against the torch already installed
(build isolation would fetch a CUDA torch). Without a compiler (or torch) the install
still succeeds: one warning, and kvstack runs its PyTorch path. ``KVSTACK_NO_KERNELS=1``
at install skips the build.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


class BinaryDistribution(Distribution):
    """A wheel with shared libraries: platform-specific, and ``build_ext`` always runs."""

    def has_ext_modules(self) -> bool:
        return True


class BuildKernels(build_ext):
    """``build_ext`` that builds the kernels into the package's library directory
    (``kernels/files.PACKAGE_DIR``; in the source tree for ``--inplace`` and editable
    installs)."""

    def run(self) -> None:
        if os.environ.get("KVSTACK_NO_KERNELS", "") not in ("", "0"):
            print("kvstack-kernels: KVSTACK_NO_KERNELS is set: not building", file=sys.stderr)
            return
        inplace = self.inplace or getattr(self, "editable_mode", False)
        sys.path.insert(0, str(ROOT / "src"))
        try:
            from kvstack.model.kernels.build import BuildError, build
            from kvstack.model.kernels.files import PACKAGE_DIR
        finally:
            sys.path.pop(0)
        # where the package keeps its libraries, in the source tree or the wheel's tree
        base = ROOT / "src" if inplace else Path(self.build_lib)
        out = base / PACKAGE_DIR.relative_to(ROOT / "src")
        try:
            build(out, ROOT / "build" / "kernels")
        except (BuildError, ImportError, OSError) as e:
            print(
                f"kvstack-kernels: WARNING: C++ kernels not built ({e}); kvstack installs "
                "without them and runs its PyTorch path (`make kernels` to retry)",
                file=sys.stderr,
            )

    def get_outputs(self) -> list[str]:
        return []


setup(cmdclass={"build_ext": BuildKernels}, distclass=BinaryDistribution)
