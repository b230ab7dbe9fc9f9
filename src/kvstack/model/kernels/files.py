"""Where the built C++ kernels live, what the build recorded, and the lock around it.

One directory (``kernel_dir``) holds one shared library per ISA level
(``kvstack_<level>.so``, ``model/kernels/isa.py``) and ``kernels.json`` (``Manifest``): the levels
built, the hash of the C++ sources they were built from, the torch version they link
against. It is the package's ``model/kernels_lib/`` (written by ``pip install`` /
``make setup`` / ``make kernels``) unless ``$KVSTACK_KERNEL_DIR`` names a directory that
holds a build of its own.

Invariants: ``kernels.json`` is written last, atomically, after every library of the
build is in place, and each library is renamed into place (never rewritten where a
running process may have it mapped), so a reader sees either the old build or the new
one. A build holds ``.lock`` exclusively (``fcntl.flock``: released by the kernel when
the process dies, so no stale lock survives a killed build); a loader holds it shared
while it reads the manifest and opens a library, so it waits for a build in progress
instead of loading half of one. Waits end after ``lock_timeout()`` seconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
PACKAGE_DIR = Path(__file__).parent / "kernels_lib"
MANIFEST = "kernels.json"
LOCK = ".lock"
SOURCES = (
    "bindings.cpp",
    "paged_attention.cpp",
    "paged_attention_codecs.cpp",
    "codec_write.cpp",
    "codec_gather.cpp",
    "kivi2_write.cpp",
    "fused_ops.cpp",
    "decode_stack.cpp",
    "decode_team.cpp",
    "token_mask.cpp",
    "argmax.cpp",
    "amx_linear.cpp",
    "bf16_linear.cpp",
    "prefill_attention.cpp",
    "quant_linear.cpp",
    "quant_vnni.cpp",
    "quant_gemv.cpp",
)
DEFAULT_LOCK_TIMEOUT_S = 30 * 60  # a full build of every level on 2 busy cores fits


class LockTimeout(TimeoutError):
    """The lock stayed held by another process for longer than the timeout."""


@dataclass(frozen=True)
class Manifest:
    """What one build made: ``levels`` (names, ``kvstack_<name>.so`` each) from C++
    sources of hash ``sources_hash`` against torch ``torch``, by ``compiler``."""

    levels: tuple[str, ...]
    sources_hash: str
    torch: str
    compiler: str
    built_at: float

    def library(self, directory: Path, level: str) -> Path:
        return directory / library_name(level)


def library_name(level: str) -> str:
    return f"kvstack_{level}.so"


def sources_hash(csrc: Path = CSRC) -> str:
    """A hash of every C++ source and header (names and bytes): a build whose hash differs
    was made from other sources (stale)."""
    digest = hashlib.sha256()
    for path in sorted([*csrc.glob("*.cpp"), *csrc.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def kernel_dir() -> Path:
    """``$KVSTACK_KERNEL_DIR`` when it holds a build (a manifest), else the package's."""
    override = os.environ.get("KVSTACK_KERNEL_DIR")
    if override and (Path(override) / MANIFEST).is_file():
        return Path(override)
    return PACKAGE_DIR


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest in ``directory``, or None (no build there, or an unreadable one)."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
        return Manifest(
            levels=tuple(str(x) for x in data["levels"]),
            sources_hash=str(data["sources_hash"]),
            torch=str(data["torch"]),
            compiler=str(data.get("compiler", "")),
            built_at=float(data.get("built_at", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``kernels.json`` atomically (a temporary file renamed over it)."""
    tmp = directory / f".{MANIFEST}.{os.getpid()}"
    data = asdict(manifest)
    data["levels"] = list(manifest.levels)
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(directory / MANIFEST)


def stale_reason(manifest: Manifest, current_hash: str, torch_version: str) -> str | None:
    """Why a build cannot be loaded with these sources and this torch, or None."""
    if manifest.sources_hash != current_hash:
        return "built from older C++ sources than these"
    if manifest.torch != torch_version:
        return f"built against torch {manifest.torch}, this is torch {torch_version}"
    return None


def lock_timeout() -> float:
    """Seconds a process waits for another's lock (``$KVSTACK_KERNEL_LOCK_TIMEOUT``)."""
    try:
        return float(os.environ.get("KVSTACK_KERNEL_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT_S))
    except ValueError:
        return DEFAULT_LOCK_TIMEOUT_S


def lock_holder(directory: Path) -> str:
    """The pid the lock file names (written by the exclusive holder), or '?'."""
    try:
        return (directory / LOCK).read_text().strip() or "?"
    except OSError:
        return "?"


@contextmanager
def locked(
    directory: Path,
    exclusive: bool,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[bool]:
    """Hold ``directory/.lock`` (exclusive for a build, shared for a load), waiting up to
    ``timeout`` seconds for another holder (``on_wait(pid)`` is called once when it must
    wait); raises ``LockTimeout`` past it. Yields whether it had to wait. A shared lock
    on a directory without a lock file (a read-only install never built into) is a no-op."""
    path = directory / LOCK
    if exclusive:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    else:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            yield False
            return
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    limit = lock_timeout() if timeout is None else timeout
    deadline, waited = time.monotonic() + limit, False
    try:
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited and on_wait is not None:
                    on_wait(lock_holder(directory))
                waited = True
                if time.monotonic() >= deadline:
                    raise LockTimeout(
                        f"{path} held by pid {lock_holder(directory)} for over {limit:.0f} s"
                    ) from None
                time.sleep(0.2)
        if exclusive:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield waited
    finally:
        os.close(fd)  # closing the descriptor releases the flock
