"""Loading the built kernels (``kernels.load_kernels``): the best level this CPU runs, and
one clear line plus a counted fallback -- never a crash -- when the build is missing,
stale, unloadable, or the CPU has no AVX2. Each case runs in a fresh interpreter (a
process loads one kernel library, once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kvstack.model.kernels import isa
from kvstack.model.kernels.files import library_name, sources_hash

SRC = str(Path(__file__).resolve().parents[2] / "src")

LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from kvstack.model.kernels import isa
from kvstack.model.kernels import loader as kernels
if len(sys.argv) > 1:
    isa.cpu = lambda: ("an old CPU", frozenset(sys.argv[1].split()))
print("loaded", kernels.load_kernels() is not None)
print("counts", dict(kernels.fallback_counts()))
print("state", kernels.kernel_state())
"""


def load_with(tmp_env: dict[str, str], *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": SRC, **tmp_env}
    env.pop("KVSTACK_NO_KERNELS", None)
    done = subprocess.run(
        [sys.executable, "-c", LOAD, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def fake_build(directory: Path, hash_: str) -> None:
    """A manifest for this CPU's levels, each library a file that is no shared object."""
    names = [lv.name for lv in isa.runnable(isa.cpu_flags())] or ["avx2"]
    for name in names:
        (directory / library_name(name)).write_bytes(b"not an ELF file")
    manifest = {"levels": names, "sources_hash": hash_, "torch": torch.__version__}
    (directory / "kernels.json").write_text(json.dumps(manifest))


def test_cpu_without_avx2_takes_the_pytorch_path() -> None:
    out = load_with({}, "sse2 sse4_2 avx")
    assert "loaded False" in out
    assert "('all', 'isa_unsupported'): 1" in out
    assert "WARNING C++ kernels off (this CPU has no AVX2 + FMA (x86-64-v3))" in out


def test_stale_build_is_detected(tmp_path: Path) -> None:
    fake_build(tmp_path, "0123456789abcdef")
    out = load_with({"KVSTACK_KERNEL_DIR": str(tmp_path)})
    if not isa.runnable(isa.cpu_flags()):
        assert "isa_unsupported" in out
        return
    assert "loaded False" in out and "('all', 'stale'): 1" in out
    assert "built from older C++ sources than these: run `make kernels`" in out


def test_library_that_fails_to_load_is_one_line_and_counted(tmp_path: Path) -> None:
    fake_build(tmp_path, sources_hash())
    out = load_with({"KVSTACK_KERNEL_DIR": str(tmp_path)})
    if not isa.runnable(isa.cpu_flags()):
        return
    assert "loaded False" in out and "('all', 'load_failed'): 1" in out
    (warning,) = [ln for ln in out.splitlines() if ln.startswith("WARNING")]
    assert "failed to load" in warning and "using the PyTorch path" in warning


def test_installed_build_loads_its_best_level() -> None:
    best = isa.choose_level(isa.cpu_flags(), isa.LEVEL_NAMES)
    if best is None:
        return
    out = load_with({"KVSTACK_KERNEL_DIR": ""})
    assert "loaded True" in out, out
    assert f"INFO C++ kernels: ISA level {best.name} " in out
    assert f"state {best.name} (" in out


def test_isa_cap_loads_a_lower_level_and_an_unknown_one_falls_back() -> None:
    if not isa.runnable(isa.cpu_flags()):
        return
    out = load_with({isa.ISA_ENV: "avx2"})
    assert "loaded True" in out and "INFO C++ kernels: ISA level avx2 " in out
    out = load_with({isa.ISA_ENV: "sse9"})
    assert "loaded False" in out and "('all', 'isa_unsupported'): 1" in out
    (warning,) = [ln for ln in out.splitlines() if ln.startswith("WARNING")]
    assert "KVSTACK_ISA='sse9' is no ISA level" in warning
