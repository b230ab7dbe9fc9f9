"""Build the C++ kernels ahead of time, one shared library per ISA level, with ninja.

Run by the package's build backend (``setup.py``'s ``build_ext``: ``pip install
--no-build-isolation -e .``, ``make setup``) and by ``make kernels`` (``python -m
kvstack.model.kernels.build``); the library is never compiled on first use. The levels are
``model/kernels/isa.py``'s: a development or CI build makes those this CPU can run,
``KVSTACK_BUILD_ALL_ISA=1`` (``pip wheel``, a container image) all of them.

Only the sources whose code depends on the ISA are compiled once per level (``plan``):
each source is preprocessed for every level with the torch headers stubbed out, and the
levels whose text of the kernel's own files comes out the same share one object,
compiled for the lowest of them (correct on every higher one). So ``bindings.cpp``,
``token_mask.cpp``, ``decode_stack.cpp``, ``kivi2_write.cpp`` and the non-AMX
``amx_linear.cpp`` compile once; a new ``#if defined(__AVX512...)`` joins its file to the
per-level set by itself. Flags: ``-O3 -ffp-contract=off -fopenmp`` (as before) with the
level's ``-march=x86-64-v3`` / ``-march=x86-64-v4`` (+ ``-mavx512bf16 -mavx512vnni``,
+ ``-mamx-*``), never ``-march=native``.

ninja makes it incremental (header dependencies from ``-MMD`` depfiles: a changed header
rebuilds what includes it) and prints one progress line per object and level. The build
holds ``files.locked`` (exclusive): a second build waits, then finds the first's
result current and reuses it instead of building again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstack.model.kernels import isa
from kvstack.model.kernels.files import (
    CSRC,
    PACKAGE_DIR,
    SOURCES,
    Manifest,
    library_name,
    locked,
    read_manifest,
    sources_hash,
    write_manifest,
)

CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-std=c++20", "-fPIC")
PROGRESS = "kvstack-kernels"  # every progress line starts with this (make setup shows them)


class BuildError(RuntimeError):
    """The kernels could not be built (no compiler, a compile error): one line."""


@dataclass(frozen=True)
class Unit:
    """One object: ``source`` compiled with level ``variant``'s flags, linked into every
    library of ``levels``."""

    source: str
    variant: str
    levels: tuple[str, ...]

    @property
    def obj(self) -> str:
        return f"{self.variant}/{Path(self.source).stem}.o"


def say(msg: str) -> None:
    print(f"{PROGRESS}: {msg}", file=sys.stderr, flush=True)


def compiler() -> str:
    """The C++ compiler (``$CXX`` or ``c++``); BuildError when there is none."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler ({cxx!r} is not on PATH)")
    return cxx


def compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return (out.stdout.splitlines() or ["unknown"])[0]


def supported(cxx: str, lv: isa.IsaLevel) -> bool:
    """Whether ``cxx`` accepts the level's flags (an old compiler may lack ``-mamx-*``)."""
    probe = subprocess.run(
        [cxx, *lv.cflags, "-x", "c++", "-E", "-o", os.devnull, os.devnull],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def stub_headers(stub: Path, csrc: Path) -> None:
    """Empty stand-ins for every torch / ATen / c10 header the sources include: ``plan``
    preprocesses the kernel's own code, fast, without torch's (ISA-independent) headers."""
    for path in [*csrc.glob("*.cpp"), *csrc.glob("*.h")]:
        for m in re.finditer(r"#include <((?:torch|ATen|c10)/[^>]+)>", path.read_text()):
            target = stub / m.group(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()


def own_text(preprocessed: str, csrc: Path) -> str:
    """The lines of preprocessor output that come from ``csrc`` (line markers tell)."""
    keep, current = [], ""
    root = str(csrc)
    for line in preprocessed.splitlines():
        if line.startswith("# "):
            parts = line.split('"')
            current = parts[1] if len(parts) > 1 else current
        elif current.startswith(root) and line.strip():
            keep.append(line)
    return "\n".join(keep)


def group_variants(source: str, digests: dict[str, str], order: list[isa.IsaLevel]) -> list[Unit]:
    """Units of ``source`` from its per-level digests: levels with equal text share one
    object compiled for the lowest of them (``order`` is lowest first). Pure."""
    by_digest: dict[str, list[str]] = {}
    for lv in order:
        by_digest.setdefault(digests[lv.name], []).append(lv.name)
    return [Unit(source, names[0], tuple(names)) for names in by_digest.values()]


def cached_plan(cache: Path, key: str) -> list[Unit] | None:
    """The units ``cache`` holds for ``key``; None when there is no plan for this key
    (none written yet, another key, or a file this version cannot read)."""
    try:
        cached = json.loads(cache.read_text())
        if cached["key"] != key:
            return None
        return [Unit(u[0], u[1], tuple(u[2])) for u in cached["units"]]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def plan(
    cxx: str,
    levels: list[isa.IsaLevel],
    build: Path,
    csrc: Path = CSRC,
    sources: tuple[str, ...] = SOURCES,
) -> list[Unit]:
    """Which objects to compile for ``levels`` (cached in ``build/plan.json`` by sources,
    levels and compiler)."""
    key_src = json.dumps(
        [
            sources_hash(csrc),
            sources,
            [(lv.name, lv.cflags) for lv in levels],
            compiler_version(cxx),
        ]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = build / "plan.json"
    if (units := cached_plan(cache, key)) is not None:
        return units
    stub = build / "stub"
    stub_headers(stub, csrc)

    def digest(job: tuple[str, isa.IsaLevel]) -> tuple[str, str, str]:
        source, lv = job
        cmd = [cxx, "-E", *CFLAGS, *lv.cflags, "-I", str(stub), "-I", str(csrc), str(csrc / source)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise BuildError(
                f"preprocessing {source} for {lv.name} failed: {out.stderr.strip()[:500]}"
            )
        return source, lv.name, hashlib.sha256(own_text(out.stdout, csrc).encode()).hexdigest()

    jobs = [(s, lv) for s in sources for lv in levels]
    digests: dict[str, dict[str, str]] = {s: {} for s in sources}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for source, name, d in pool.map(digest, jobs):
            digests[source][name] = d
    units = [u for s in sources for u in group_variants(s, digests[s], levels)]
    cache.write_text(
        json.dumps({"key": key, "units": [[u.source, u.variant, list(u.levels)] for u in units]})
    )
    return units


def ninja_file(
    cxx: str, units: list[Unit], levels: list[isa.IsaLevel], out: Path, csrc: Path
) -> str:
    """The build.ninja text: one compile rule per level, one link per library. A library
    is linked to a temporary name and renamed into place (a process may have the old one
    mapped)."""
    from torch import _C
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(_C._GLIBCXX_USE_CXX11_ABI)}"
    inc = " ".join(f"-isystem {p}" for p in include_paths())
    libs = " ".join(f"-L{p}" for p in library_paths())
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {cxx}",
        f"common = -I{csrc} {inc} {' '.join(CFLAGS)} {abi}",
        "",
    ]
    for lv in levels:
        lines += [
            f"rule cc_{lv.name}",
            f"  command = $cxx -MMD -MF $out.d $common {' '.join(lv.cflags)} -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            f"  description = compile {lv.name:<11} $src",
            "",
        ]
    lines += [
        "rule link",
        f"  command = $cxx $in -shared -fopenmp {libs} -lc10 -ltorch_cpu -ltorch -o $out.tmp"
        " && mv -f $out.tmp $out",
        "  description = link $out",
        "",
    ]
    for u in units:
        lines += [f"build {u.obj}: cc_{u.variant} {csrc / u.source}", f"  src = {u.source}"]
    for lv in levels:
        objs = " ".join(u.obj for u in units if lv.name in u.levels)
        lines.append(f"build {out / library_name(lv.name)}: link {objs}")
    return "\n".join(lines) + "\n"


def run_ninja(build: Path) -> None:
    ninja = shutil.which("ninja") or shutil.which("ninja", path=os.path.dirname(sys.executable))
    if ninja is None:
        raise BuildError("ninja is not installed (pip install ninja)")
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    env = {**os.environ, "NINJA_STATUS": f"{PROGRESS}: [%f/%t] "}
    cmd = [ninja, "-C", str(build), "-j", jobs]
    done = subprocess.run(cmd, env=env, stdout=sys.stderr.fileno(), check=False)
    if done.returncode != 0:
        raise BuildError(f"the kernel build failed (ninja exit {done.returncode}; errors above)")


def current(out: Path, names: list[str], torch_version: str, csrc: Path = CSRC) -> bool:
    """Whether ``out`` already holds these levels built from these sources and torch."""
    m = read_manifest(out)
    return (
        m is not None
        and m.sources_hash == sources_hash(csrc)
        and m.torch == torch_version
        and set(names) <= set(m.levels)
        and all((out / library_name(n)).is_file() for n in names)
    )


def build(
    out: Path = PACKAGE_DIR,
    build_dir: Path | None = None,
    every: bool | None = None,
    csrc: Path = CSRC,
    sources: tuple[str, ...] = SOURCES,
) -> Manifest:
    """Build the levels (those this CPU runs, or all with ``every`` /
    ``$KVSTACK_BUILD_ALL_ISA``) of ``sources`` in ``csrc`` into ``out``; waits for a build
    in progress and reuses it when current. Raises BuildError (one line) when it cannot."""
    import torch

    cxx = compiler()
    if every is None:
        every = os.environ.get("KVSTACK_BUILD_ALL_ISA", "") not in ("", "0")
    wanted = isa.levels_to_build(isa.cpu_flags(), every)
    levels = [lv for lv in wanted if supported(cxx, lv)]
    for lv in wanted:
        if lv not in levels:
            say(f"skipping level {lv.name}: {cxx} does not accept {' '.join(lv.cflags)}")
    if not levels:
        raise BuildError("no ISA level to build: this CPU has no AVX2 + FMA (x86-64-v3)")
    names = [lv.name for lv in levels]
    build_dir = build_dir or out / "build"
    out.mkdir(parents=True, exist_ok=True)

    def waiting(pid: str) -> None:
        say(f"waiting for the build of pid {pid}")

    # the library directory (loaders wait on it), then the objects' (another output
    # directory's build may share them); always in this order, so builders never deadlock
    with locked(out, exclusive=True, on_wait=waiting):
        if current(out, names, torch.__version__, csrc):
            say(f"up to date ({', '.join(names)}) in {out}")
            return read_manifest(out)  # type: ignore[return-value]
        with locked(build_dir, exclusive=True, on_wait=waiting):
            return compile_levels(cxx, levels, out, build_dir, csrc, sources)


def compile_levels(
    cxx: str,
    levels: list[isa.IsaLevel],
    out: Path,
    build_dir: Path,
    csrc: Path,
    sources: tuple[str, ...],
) -> Manifest:
    """Plan, write build.ninja, run ninja, then write the manifest (last)."""
    import torch

    names = [lv.name for lv in levels]
    t0 = time.monotonic()
    units = plan(cxx, levels, build_dir, csrc, sources)
    say(f"building {', '.join(names)}: {len(units)} objects ({len(sources)} sources)")
    text = ninja_file(cxx, units, levels, out.resolve(), csrc)
    (build_dir / "build.ninja").write_text(text)
    run_ninja(build_dir)
    manifest = Manifest(
        tuple(names), sources_hash(csrc), torch.__version__, compiler_version(cxx), time.time()
    )
    write_manifest(out, manifest)
    say(f"built {', '.join(names)} into {out} in {time.monotonic() - t0:.0f} s")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvstack.model.kernels.build",
        description="Build kvstack's C++ kernels (incremental; `make kernels`).",
    )
    p.add_argument("--out", type=Path, default=PACKAGE_DIR, help="library directory")
    p.add_argument(
        "--build-dir", type=Path, default=None, help="ninja's objects (default OUT/build)"
    )
    p.add_argument("--all", action="store_true", help="every ISA level, not only this CPU's")
    args = p.parse_args(argv)
    try:
        build(args.out, args.build_dir, True if args.all else None)
    except BuildError as e:
        print(f"{PROGRESS}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
