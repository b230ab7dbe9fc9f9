"""The one place that decides which instruction-set level the C++ kernels run at.

The kernels are built ahead of time (at ``pip install`` / ``make setup``, or ``make
kernels``: ``model/kernels/build.py``), once per **ISA level** below, never with
``-march=native``, so a wheel or a container image carries code for every x86-64 CPU it
may meet. At run time ``choose_level`` takes the best level this CPU can run among those
built -- the scheme of vLLM's CPU wheel (AVX2 / AVX-512 / AMX picked at load) and of
llama.cpp's ``GGML_CPU_ALL_VARIANTS`` (every variant built, the best one loaded).

Levels, each a superset of the one before (``IsaLevel.cflags`` / ``IsaLevel.cpu_flags``):

- ``avx2``: x86-64-v3 (AVX2, FMA, F16C, BMI1/2): AMD Zen 1-3, Intel Haswell and later;
- ``avx512``: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL): Skylake-SP .. Ice Lake Xeons;
- ``avx512_bf16``: v4 + AVX512-BF16 + AVX512-VNNI: AMD Zen 4/5, Cooper Lake;
- ``amx``: that + AMX tiles (TILE, BF16, INT8): Sapphire Rapids and later Xeons.

A CPU without AVX2 runs no kernel: a warning, and every op takes the PyTorch path (never
an illegal instruction). Every other ISA question of the model code is answered here
from the level loaded (``active``): which bf16 tile kernel the linears use
(``tile_kernel_name``), whether the int8 dot product is the AVX2 one
(``int8_dot_is_avx2``), whether the causal prefill kernel exists (``causal_attention``),
whether AMX may be asked for (``amx_level``), whether oneDNN has native bf16
(``onednn_bf16``), and which dtype ``--dtype auto`` picks (``auto_dtype``, from the fixed
table ``AUTO_DTYPE``). Invariant: a level is chosen only when every one of its
``cpu_flags`` is in ``/proc/cpuinfo``, so the library loaded never holds an instruction
this CPU lacks. ``KVSTACK_ISA`` (``capped``) lowers the level chosen, e.g. to test the
AVX2 kernels on an AVX-512 machine (one level per process: a library is loaded once).
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kvstack.kernels")

V3 = ("-march=x86-64-v3",)
V4 = ("-march=x86-64-v4",)
BF16_VNNI = ("-mavx512bf16", "-mavx512vnni")
AMX = ("-mamx-tile", "-mamx-bf16", "-mamx-int8")
# x86-64-v3's flags as /proc/cpuinfo spells them (abm = LZCNT); v2's (sse4_2, popcnt,
# ssse3, cx16) are implied by any CPU with these.
V3_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse4_2", "popcnt")
V4_FLAGS = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")


@dataclass(frozen=True)
class IsaLevel:
    """One build of the kernels: compiled with ``cflags``, loadable on a CPU whose
    ``/proc/cpuinfo`` lists every one of ``cpu_flags``. ``rank`` orders the levels
    (higher runs more instructions; each level's flags include the lower ones')."""

    name: str
    rank: int
    cflags: tuple[str, ...]
    cpu_flags: frozenset[str]
    summary: str


LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx2", 1, V3, frozenset(V3_FLAGS), "x86-64-v3: AVX2 + FMA"),
    IsaLevel("avx512", 2, V4, frozenset(V3_FLAGS + V4_FLAGS), "x86-64-v4: AVX-512"),
    IsaLevel(
        "avx512_bf16",
        3,
        V4 + BF16_VNNI,
        frozenset((*V3_FLAGS, *V4_FLAGS, "avx512_bf16", "avx512_vnni")),
        "x86-64-v4 + AVX512-BF16 + AVX512-VNNI",
    ),
    IsaLevel(
        "amx",
        4,
        V4 + BF16_VNNI + AMX,
        frozenset(
            (*V3_FLAGS, *V4_FLAGS, "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
        ),
        "AVX512-BF16/VNNI + AMX tiles",
    ),
)
LEVEL_NAMES = tuple(level.name for level in LEVELS)


def level(name: str) -> IsaLevel:
    """The level called ``name`` (KeyError for an unknown one)."""
    for lv in LEVELS:
        if lv.name == name:
            return lv
    raise KeyError(f"unknown ISA level {name!r} (known: {', '.join(LEVEL_NAMES)})")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """``(model name, flags)`` of the first processor listed in ``/proc/cpuinfo`` text."""
    model, flags = "", ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = value
    return model, frozenset(flags.split())


_cpu: tuple[str, frozenset[str]] | None = None


def cpu() -> tuple[str, frozenset[str]]:
    """This machine's CPU model and flags (read once). Off Linux: the platform's name and
    no flags, so no level is chosen and the PyTorch path runs."""
    global _cpu
    if _cpu is None:
        try:
            _cpu = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
        except OSError:
            _cpu = (platform.processor() or platform.machine(), frozenset())
        if not _cpu[0]:
            _cpu = (platform.processor() or platform.machine(), _cpu[1])
    return _cpu


def cpu_model() -> str:
    return cpu()[0]


def cpu_flags() -> frozenset[str]:
    return cpu()[1]


def runnable(flags: Iterable[str]) -> list[IsaLevel]:
    """The levels a CPU with ``flags`` can run, lowest first."""
    have = set(flags)
    return [lv for lv in LEVELS if lv.cpu_flags <= have]


def choose_level(flags: Iterable[str], built: Iterable[str]) -> IsaLevel | None:
    """The best level among ``built`` (names) that a CPU with ``flags`` can run, or None
    (a CPU without AVX2, or nothing built that it can run). Pure: the tests give it flag
    sets of CPUs other than this one."""
    names = set(built)
    usable = [lv for lv in runnable(flags) if lv.name in names]
    return usable[-1] if usable else None


ISA_ENV = "KVSTACK_ISA"  # e.g. avx2: load no level above this one (tests run both paths)


def capped(built: Iterable[str], cap: str | None) -> list[str]:
    """The levels of ``built`` at or below ``cap`` (a level name; None or empty: all of
    them). ``KVSTACK_ISA=avx2`` on an AVX-512 CPU runs the AVX2 kernels, so one machine
    tests both code paths; it never raises a level. KeyError for an unknown ``cap``."""
    if not cap:
        return list(built)
    rank = level(cap).rank
    return [name for name in built if level(name).rank <= rank]


def levels_to_build(flags: Iterable[str], every: bool) -> list[IsaLevel]:
    """What a build makes: every level for a wheel or an image (``every``), else the ones
    this CPU can run (a development or CI build: the others could not be loaded here)."""
    return list(LEVELS) if every else runnable(flags)


_active: IsaLevel | None = None


def set_active(chosen: IsaLevel | None) -> None:
    """Record the level whose library ``kernels.load_kernels`` loaded (None: none)."""
    global _active
    _active = chosen


def active() -> IsaLevel | None:
    """The level of the kernels loaded in this process, or None (none loaded)."""
    return _active


def at_least(name: str) -> bool:
    """Whether the loaded kernels are of level ``name`` or a higher one."""
    return _active is not None and _active.rank >= level(name).rank


def amx_level() -> bool:
    """Whether the AMX build is loaded (the kernel must still be granted the tile state by
    ``arch_prctl``: ``amx_linear_available`` in ``csrc/amx_linear.cpp`` asks)."""
    return at_least("amx")


def causal_attention() -> bool:
    """Whether the causal prefill kernel is built in (``csrc/prefill_attention.cpp`` runs
    on AVX512-BF16 dot products only)."""
    return at_least("avx512_bf16")


def int8_dot_is_avx2() -> bool:
    """Whether ``quant_linear_vnni`` is the AVX2 kernel (vpmaddubsw + vpmaddwd): the
    ``avx2`` level is loaded; AVX-512 levels have the AVX-512 (VNNI) dot product."""
    return _active is not None and _active.name == "avx2"


_onednn_bf16: bool | None = None


def onednn_bf16() -> bool:
    """Whether PyTorch's oneDNN runs bf16 linears natively on this CPU (AMX or AVX512-BF16),
    decided once. oneDNN also accepts bf16 on plain AVX-512 (Skylake-SP .. Ice Lake, or a
    virtual machine that hides the bf16 flags) but converts in software there, 3-5x slower
    than float32 GEMM (``benchmarks/linear_kernels.py``), so that counts as no."""
    global _onednn_bf16
    if _onednn_bf16 is None:
        import torch

        try:
            _onednn_bf16 = bool(
                torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
            )
        except (AttributeError, RuntimeError):
            _onednn_bf16 = False
    return _onednn_bf16


def tile_kernel_name(compiled: str, amx_granted: bool, onednn: bool) -> str | None:
    """Which bf16 tile kernel the linears use (``model/kernels/packed_linear.py``), from the ISA
    the loaded ``bf16_linear`` was compiled for (``compiled``: ``bf16_linear_isa()``),
    whether AMX tiles were granted and whether oneDNN has native bf16; None: oneDNN (or
    ``F.linear``) runs every linear. AMX wins over AVX512-BF16; the FMA kernels run only
    where oneDNN has no native bf16 (they widen to float32)."""
    if amx_granted and amx_level():
        return "amx"
    if compiled == "avx512_bf16":
        return "avx512_bf16"
    if compiled in ("avx512_fma", "avx2_fma") and not onednn:
        return compiled
    return None


# ``--dtype auto``: the model dtype per ISA level, a fixed table (no start-up timing, so a
# run is reproducible): bfloat16 where the CPU has bf16 instructions (AVX512-BF16
# ``vdpbf16ps``, AMX-BF16 tiles), float32 elsewhere, where every bf16 product is widened
# to float32 in software (kvstack's FMA tile kernels, ATen) and oneDNN has no native bf16
# GEMM. "none": no AVX2, so no kernels at all. The level is the best one the CPU can run
# (``runnable``), whether or not its kernels are built: oneDNN's bf16 depends on the CPU.
# Without native bf16 (AVX2, AVX-512 without BF16) bf16 is a storage type: weights and KV
# are read as bf16 (half float32's bytes) and widened to float32 in registers or for an
# fp32 GEMM. Decode reads every weight once a token, so it wins there: on a 2-core AMD
# Zen 3 (AVX2), Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 2 threads, decode ran 6.05 tok/s in
# bf16 vs 1.8 in float32 (7.5-8.1 vs 3.7 with --quantization gguf), while a 512-token
# prompt took 19.9 s vs 16.6 s (prefill 1.2x slower). Only a CPU without AVX2, where no
# kernel widens, gets float32.
AUTO_DTYPE: dict[str, str] = {
    "none": "float32",
    "avx2": "bfloat16",
    "avx512": "bfloat16",
    "avx512_bf16": "bfloat16",
    "amx": "bfloat16",
}
NATIVE_BF16_LEVELS = frozenset({"avx512_bf16", "amx"})


@dataclass(frozen=True)
class DtypeChoice:
    """What ``--dtype auto`` picks on a CPU: ``dtype`` from ``AUTO_DTYPE[level]``, where
    ``level`` is the best ISA level the CPU runs ("none": not even AVX2). Invariant:
    ``native_bf16`` is True exactly on the levels with bf16 instructions; a bfloat16
    choice without them is bf16 storage with float32 compute."""

    dtype: str
    level: str

    @property
    def native_bf16(self) -> bool:
        return self.level in NATIVE_BF16_LEVELS

    def reason(self) -> str:
        """Why, in words: ``CPU has avx2, no avx512_bf16/AMX: bf16 storage, float32 compute``."""
        if self.level == "amx":
            return "CPU has AMX-BF16 tiles: bf16 runs natively"
        if self.level == "avx512_bf16":
            return "CPU has avx512_bf16: bf16 runs natively"
        if self.level == "none":
            return "CPU has no AVX2 (no kernels): bf16 would be emulated"
        shown = "avx512f" if self.level == "avx512" else self.level
        return (
            f"CPU has {shown}, no avx512_bf16/AMX: bf16 storage, float32 compute (a decode "
            "step reads half the bytes of float32)"
        )


def auto_dtype(flags: Iterable[str] | None = None) -> DtypeChoice:
    """The dtype ``--dtype auto`` resolves to on a CPU with ``flags`` (default: this one's,
    from ``/proc/cpuinfo``): the one place that decision is made (config resolution,
    ``kvstack doctor`` and the start-up log all call it). Pure given ``flags``."""
    levels = runnable(cpu_flags() if flags is None else flags)
    name = levels[-1].name if levels else "none"
    return DtypeChoice(AUTO_DTYPE[name], name)


def emulated_bf16_warning(choice: DtypeChoice) -> str:
    """The warning for bfloat16 asked for where ``auto`` picks float32 (allowed)."""
    return (
        f"dtype bfloat16 on a CPU without AVX2 ({choice.reason()}): no kvstack kernel widens "
        "bf16 here, so every bf16 op takes PyTorch's generic path (not measured on such a "
        f"CPU: expect it slower than float32); --dtype auto picks {choice.dtype} here"
    )
