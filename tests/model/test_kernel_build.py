"""The kernels' build directory is per CPU: the build uses ``-march=native``, so a cache
made on an AMX Xeon must never be loaded on a CPU without those instructions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstack.model.kernels import loader as kernels


def fake_cpuinfo(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    real = Path.read_text

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        return text if str(self) == "/proc/cpuinfo" else real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", read_text)


def test_build_dir_is_per_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSTACK_KERNEL_DIR", str(tmp_path))
    xeon = "model name\t: Xeon\nflags\t\t: avx512f amx_bf16\n"
    two_cores = xeon + "processor\t: 1\n" + xeon  # every core repeats the same lines
    fake_cpuinfo(monkeypatch, two_cores)
    a = kernels.build_dir()
    fake_cpuinfo(monkeypatch, xeon)
    assert kernels.build_dir() == a  # one directory however many cores list the flags
    fake_cpuinfo(monkeypatch, "model name\t: EPYC\nflags\t\t: avx512f\n")
    b = kernels.build_dir()
    assert a != b and a.parent == b.parent == tmp_path and a.is_dir() and b.is_dir()


def test_a_killed_builds_lock_is_cleared(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    assert not kernels.clear_stale_lock(tmp_path)  # none
    lock.touch()
    now = lock.stat().st_mtime
    assert not kernels.clear_stale_lock(tmp_path, now + 60)  # a build may be running
    assert lock.exists()
    assert kernels.clear_stale_lock(tmp_path, now + kernels.STALE_LOCK_S + 1)
    assert not lock.exists()
