"""The ahead-of-time kernel build (``model/kernels/build.py``): only ISA-dependent sources
are compiled per level, two concurrent builds build once, and the AVX2 library holds no
AVX-512 instruction (an AVX2-only CPU would die on one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstack.model.kernels import isa
from kvstack.model.kernels.build import Unit, group_variants, plan
from kvstack.model.kernels.files import kernel_dir, read_manifest

needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_equal_text_shares_the_lowest_levels_object() -> None:
    levels = list(isa.LEVELS)
    same = {lv.name: "x" for lv in levels}
    assert group_variants("a.cpp", same, levels) == [Unit("a.cpp", "avx2", isa.LEVEL_NAMES)]
    amx_only = {**same, "amx": "y"}
    assert group_variants("b.cpp", amx_only, levels) == [
        Unit("b.cpp", "avx2", ("avx2", "avx512", "avx512_bf16")),
        Unit("b.cpp", "amx", ("amx",)),
    ]
    assert Unit("b.cpp", "amx", ("amx",)).obj == "amx/b.o"


@needs_cxx
def test_plan_duplicates_only_isa_dependent_sources(tmp_path: Path) -> None:
    units = plan("c++", list(isa.LEVELS), tmp_path)
    by_source: dict[str, list[Unit]] = {}
    for u in units:
        by_source.setdefault(u.source, []).append(u)
    for shared in ("bindings.cpp", "token_mask.cpp", "decode_stack.cpp", "kivi2_write.cpp"):
        assert [u.levels for u in by_source[shared]] == [isa.LEVEL_NAMES], shared
    assert [u.variant for u in by_source["amx_linear.cpp"]] == ["avx2", "amx"]
    for per_level in ("fused_ops.cpp", "bf16_linear.cpp", "paged_attention.cpp"):
        assert {u.variant for u in by_source[per_level]} >= {"avx2", "avx512", "avx512_bf16"}
    # every level links exactly one object of every source
    for lv in isa.LEVEL_NAMES:
        assert sorted(u.source for u in units if lv in u.levels) == sorted(by_source)
    assert plan("c++", list(isa.LEVELS), tmp_path) == units  # cached by sources and flags


SLOW_CXX = """#!/bin/sh
# a compiler whose compiles log themselves and wait for the test's gate (up to 120 s),
# so the second build surely starts while the first holds the lock
case " $* " in *" -c "*)
  echo "$$" >> "{log}"
  i=0; while [ ! -e "{gate}" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done;;
esac
exec c++ "$@"
"""

BUILD = """
import sys
from pathlib import Path
from kvstack.model.kernels.build import build
d = Path(sys.argv[1])
build(d / "out", d / "build", csrc=d / "csrc", sources=("probe.cpp",))
"""


@needs_cxx
def test_two_concurrent_builds_build_once(tmp_path: Path) -> None:
    if not isa.runnable(isa.cpu_flags()):
        pytest.skip("this CPU builds no level (no AVX2)")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "probe.cpp").write_text("int kvstack_probe() { return 1; }\n")
    log = tmp_path / "compiles.log"
    cxx = tmp_path / "slow-c++"
    gate = tmp_path / "gate"
    cxx.write_text(SLOW_CXX.format(log=log, gate=gate))
    cxx.chmod(0o755)
    env = {**os.environ, "CXX": str(cxx), "PYTHONPATH": SRC, "KVSTACK_KERNEL_LOCK_TIMEOUT": "120"}

    def start() -> subprocess.Popen[str]:
        cmd = [sys.executable, "-c", BUILD, str(tmp_path)]
        return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)

    first = start()
    lock = tmp_path / "out" / ".lock"
    for _ in range(600):  # until the first holds the lock (its pid written)
        if lock.exists() and lock.read_text().strip() == str(first.pid):
            break
        time.sleep(0.1)
    second = start()
    assert second.stderr is not None
    seen = []
    while line := second.stderr.readline():  # until it waits on the first's lock
        seen.append(line)
        if "waiting for the build" in line:
            break
    gate.touch()  # now let the first build compile
    _, err1 = first.communicate(timeout=300)
    _, err2 = second.communicate(timeout=300)
    err2 = "".join(seen) + err2
    assert first.returncode == 0 and second.returncode == 0, err1 + err2
    assert "building" in err1 and re.search(r"\[\d+/\d+\] compile", err1), err1
    assert f"waiting for the build of pid {first.pid}" in err2, err2
    assert "up to date" in err2 and "building" not in err2, err2
    assert len(log.read_text().split()) == 1  # one object (no ISA text), compiled once
    manifest = read_manifest(tmp_path / "out")
    assert manifest is not None
    assert list(manifest.levels) == [lv.name for lv in isa.runnable(isa.cpu_flags())]


EVEX = re.compile(r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|%k[0-7]\b")


def avx512_lines(library: Path) -> list[str]:
    """Instructions of ``library`` that need AVX-512: a zmm / k / x|ymm16-31 register, or
    an EVEX prefix (first opcode byte 0x62, invalid in 64-bit mode otherwise)."""
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = [ln for ln in out.stdout.splitlines() if EVEX.search(ln)]
    raw = subprocess.run(
        ["objdump", "-d", str(library)], capture_output=True, text=True, check=True
    )
    for line in raw.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and re.match(r"\s*(6[4567] )*62 ", parts[1]):
            found.append(line)
    return found


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump missing")
def test_avx2_library_has_no_avx512_instruction() -> None:
    if not isa.runnable(isa.cpu_flags()):
        pytest.skip("this CPU builds no level (no AVX2)")
    directory = kernel_dir()
    manifest = read_manifest(directory)
    assert manifest is not None and "avx2" in manifest.levels, f"no kernel build in {directory}"
    bad = avx512_lines(manifest.library(directory, "avx2"))
    assert bad == [], bad[:5]
    if "avx512" in manifest.levels:  # the detector sees AVX-512 where it is
        assert avx512_lines(manifest.library(directory, "avx512"))


def test_install_without_a_compiler_warns_once_and_succeeds(tmp_path: Path) -> None:
    """``setup.py build_ext`` (what pip runs) with no compiler: exit 0, one warning."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "PYTHONPATH": SRC}
    env.pop("KVSTACK_NO_KERNELS", None)
    cmd = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    warnings = [ln for ln in done.stderr.splitlines() if "kvstack-kernels: WARNING" in ln]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0], done.stderr
    assert "PyTorch path" in warnings[0]


BEYOND = {  # instructions a level's library must not hold: they need the next level
    "avx512": re.compile(r"\s(vdpbf16ps|vcvtne2?ps2bf16|vpdpbusds?|vpdpwssds?)\s"),
    "avx512_bf16": re.compile(r"\s(tdp\w+|tileloadd\w*|ldtilecfg|tilestored|tilezero)\s"),
}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump missing")
def test_avx512_libraries_stay_within_their_level() -> None:
    directory = kernel_dir()
    manifest = read_manifest(directory)
    if manifest is None or not set(BEYOND) & set(manifest.levels):
        pytest.skip("no AVX-512 level built on this CPU")
    for name, pattern in BEYOND.items():
        if name in manifest.levels:
            lib = manifest.library(directory, name)
            out = subprocess.run(
                ["objdump", "-d", "--no-show-raw-insn", str(lib)],
                capture_output=True,
                text=True,
                check=True,
            )
            bad = [ln for ln in out.stdout.splitlines() if pattern.search(ln + " ")]
            assert bad == [], (name, bad[:5])
