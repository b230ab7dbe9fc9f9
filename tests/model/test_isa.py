"""The ISA dispatch (``model/kernels/isa.py``): which kernel level a CPU gets, from its flags alone.

Flag sets are those real CPUs list in ``/proc/cpuinfo`` (trimmed to what matters): the
choice must never be a level the CPU lacks an instruction of (an illegal instruction),
and must be the best one built."""

from __future__ import annotations

import pytest

from kvstack.model.kernels import isa

V2 = {"sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16"}
SANDY_BRIDGE = V2 | {"avx"}  # AVX without AVX2: no kernel level
ZEN3 = V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ICE_LAKE = SKYLAKE_SP | {"avx512_vnni", "avx512vbmi"}  # VNNI but no BF16
ZEN4 = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
ALL = isa.LEVEL_NAMES


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (set(), None),
        (V2, None),
        (SANDY_BRIDGE, None),
        (ZEN3 - {"fma"}, None),  # AVX2 without FMA is not x86-64-v3
        (ZEN3, "avx2"),
        (SKYLAKE_SP, "avx512"),
        (SKYLAKE_SP - {"avx512vl"}, "avx2"),  # a partial AVX-512 is not x86-64-v4
        (ICE_LAKE, "avx512"),
        (ZEN4, "avx512_bf16"),
        (ZEN4 - {"avx512_vnni"}, "avx512"),
        (SAPPHIRE_RAPIDS, "amx"),
        (SAPPHIRE_RAPIDS - {"amx_int8"}, "avx512_bf16"),
    ],
)
def test_best_level_for_a_cpu(flags: set[str], expected: str | None) -> None:
    chosen = isa.choose_level(flags, ALL)
    assert (chosen.name if chosen else None) == expected
    if chosen is not None:  # never an instruction the CPU lacks
        assert chosen.cpu_flags <= flags


def test_only_built_levels_are_chosen() -> None:
    assert isa.choose_level(SAPPHIRE_RAPIDS, ["avx2", "avx512"]).name == "avx512"  # type: ignore[union-attr]
    assert isa.choose_level(ZEN4, ["avx2"]).name == "avx2"  # type: ignore[union-attr]
    assert isa.choose_level(ZEN3, ["avx512", "amx"]) is None  # a wheel built elsewhere, partly
    assert isa.choose_level(ZEN4, []) is None


def test_levels_built_here_or_all() -> None:
    assert [lv.name for lv in isa.levels_to_build(ZEN4, every=False)] == [
        "avx2",
        "avx512",
        "avx512_bf16",
    ]
    assert [lv.name for lv in isa.levels_to_build(ZEN3, every=False)] == ["avx2"]
    assert isa.levels_to_build(SANDY_BRIDGE, every=False) == []
    assert [lv.name for lv in isa.levels_to_build(SANDY_BRIDGE, every=True)] == list(ALL)


def test_levels_are_ordered_supersets_without_native() -> None:
    for lower, higher in zip(isa.LEVELS, isa.LEVELS[1:], strict=False):
        assert lower.rank < higher.rank
        assert lower.cpu_flags < higher.cpu_flags
    assert all("native" not in " ".join(lv.cflags) for lv in isa.LEVELS)
    assert isa.level("avx2").cflags == ("-march=x86-64-v3",)
    with pytest.raises(KeyError, match="unknown ISA level"):
        isa.level("sse2")


def test_parse_cpuinfo_takes_the_first_processor() -> None:
    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 fma\n"
    )
    assert isa.parse_cpuinfo(text) == ("AMD EPYC 9B14", frozenset({"fpu", "avx2", "fma"}))
    assert isa.parse_cpuinfo("") == ("", frozenset())


@pytest.mark.parametrize(
    ("compiled", "amx", "onednn", "expected"),
    [
        ("avx512_bf16", False, True, "avx512_bf16"),
        ("avx512_fma", False, False, "avx512_fma"),
        ("avx512_fma", False, True, None),  # oneDNN's native bf16 wins over widening
        ("avx2_fma", False, False, "avx2_fma"),
        ("avx2_fma", False, True, None),
        ("none", False, False, None),
    ],
)
def test_tile_kernel_by_isa(compiled: str, amx: bool, onednn: bool, expected: str | None) -> None:
    assert isa.tile_kernel_name(compiled, amx, onednn) == expected
