"""The profile's figures: per operator and phase, time, FLOPs, bytes, arithmetic
intensity and the achieved fraction of the roofline bound; as a table, JSON and a PNG.

An operator at intensity ``I = FLOPs / bytes`` may reach ``min(peak, I x bandwidth)``
FLOP/s (Williams et al., "Roofline", CACM 2009); it is *memory-bound* when ``I`` is
below the ridge ``peak / bandwidth``, else *compute-bound*. ``fraction_of_bound`` is the
achieved FLOP/s over that attainable figure (for memory-bound operators: achieved bytes/s
over bandwidth). ``other`` is the step's wall time outside the operators.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path
from typing import Any

import torch

from kvstack.model.kernels import isa
from kvstack.tools.profile.bounds import MachineBounds
from kvstack.tools.profile.run import PhaseResult, Workload

SCHEMA = "kvstack-profile/1"


def machine() -> dict[str, Any]:
    """CPU model, its SIMD/AMX flags, threads, load average, torch version."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    model, flags = isa.cpu()
    info["cpu_model"] = model or "unknown"
    info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))
    info["kernel_level"] = level.name if (level := isa.active()) is not None else None
    try:
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        info["loadavg"] = None
    return info


def op_rows(phase: PhaseResult, bounds: MachineBounds) -> list[dict[str, Any]]:
    """One row per operator (slowest first), then ``other``."""
    rows = []
    steps = max(phase.steps, 1)
    for name, st in sorted(phase.ops.items(), key=lambda kv: -kv[1].seconds):
        intensity = st.flops / st.bytes if st.bytes else 0.0
        achieved = st.flops / st.seconds if st.seconds else 0.0
        attainable = bounds.attainable(intensity)
        rows.append(
            {
                "name": name,
                "calls": st.calls,
                "seconds": st.seconds,
                "ms_per_step": 1e3 * st.seconds / steps,
                "share_of_step": st.seconds / phase.wall_s if phase.wall_s else 0.0,
                "flops": st.flops,
                "bytes": st.bytes,
                "intensity_flop_per_byte": intensity,
                "achieved_gflop_s": achieved / 1e9,
                "achieved_gb_s": (st.bytes / st.seconds if st.seconds else 0.0) / 1e9,
                "attainable_gflop_s": attainable / 1e9,
                "fraction_of_bound": achieved / attainable if attainable else 0.0,
                "bound": "compute" if intensity >= bounds.ridge else "memory",
            }
        )
    other = phase.wall_s - sum(st.seconds for st in phase.ops.values())
    rows.append(
        {
            "name": "other",
            "seconds": max(other, 0.0),
            "ms_per_step": 1e3 * max(other, 0.0) / steps,
            "share_of_step": max(other, 0.0) / phase.wall_s if phase.wall_s else 0.0,
            "bound": "overhead",
        }
    )
    return rows


def build_report(
    model: str,
    dtype: str,
    codec: str,
    w: Workload,
    phases: tuple[PhaseResult, PhaseResult],
    bounds: MachineBounds,
    kv_bytes_per_token: float,
) -> dict[str, Any]:
    """The JSON document ``kvstack profile --json`` writes and ``kvstack plan`` reads."""
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": model,
        "dtype": dtype,
        "kv_cache_dtype": codec,
        "batch": w.batch,
        "context": w.context,
        "decode_steps": w.steps,
        "kv_bytes_per_token": kv_bytes_per_token,  # K+V of all layers, codec bytes
        "bounds": bounds.to_dict(),
        "phases": {},
    }
    for ph in phases:
        out["phases"][ph.name] = {
            "steps": ph.steps,
            "tokens": ph.tokens,
            "wall_s": ph.wall_s,
            "tokens_per_s": ph.tokens / ph.wall_s if ph.wall_s else 0.0,
            "step_ms_median": 1e3 * sorted(ph.step_walls)[len(ph.step_walls) // 2]
            if ph.step_walls
            else 0.0,
            "flops_per_token": sum(s.flops for s in ph.ops.values()) / max(ph.tokens, 1),
            "bytes_per_token": sum(s.bytes for s in ph.ops.values()) / max(ph.tokens, 1),
            "context_lens": ph.context_lens,
            "ops": op_rows(ph, bounds),
        }
    return out


def format_table(report: dict[str, Any]) -> str:
    """Markdown tables, one per phase, plus the machine and bounds line."""
    m, b = report["machine"], report["bounds"]
    lines = [
        f"{report['model']} {report['dtype']}, weights "
        f"{report.get('quantization', 'none')}, KV {report['kv_cache_dtype']}, batch "
        f"{report['batch']} x {report['context']} tokens; {m.get('cpu_model')} "
        f"({m.get('threads')} threads, load {' '.join(m.get('loadavg') or [])})",
        f"bounds (measured): memory {b['bandwidth_gb_s']:.1f} GB/s, GEMM "
        f"{b['peak_gflop_s']:.0f} GFLOP/s at M = 2048, ridge "
        f"{b['ridge_flop_per_byte']:.0f} FLOP/byte",
    ]
    for name, ph in report["phases"].items():
        lines += [
            "",
            f"{name}: {ph['steps']} steps, {ph['tokens']} tokens, {ph['tokens_per_s']:.0f} "
            f"tok/s, median step {ph['step_ms_median']:.1f} ms",
            "| operator | ms/step | share | GFLOP | MB | FLOP/B | GFLOP/s | GB/s | of bound "
            "| bound |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in ph["ops"]:
            if r["name"] == "other":
                lines.append(
                    f"| other (Python, sampling, inputs) | {r['ms_per_step']:.2f} | "
                    f"{100 * r['share_of_step']:.0f}% | | | | | | | |"
                )
                continue
            lines.append(
                f"| {r['name']} | {r['ms_per_step']:.2f} | {100 * r['share_of_step']:.0f}% | "
                f"{r['flops'] / 1e9:.2f} | {r['bytes'] / 1e6:.1f} | "
                f"{r['intensity_flop_per_byte']:.1f} | {r['achieved_gflop_s']:.1f} | "
                f"{r['achieved_gb_s']:.1f} | {100 * r['fraction_of_bound']:.0f}% | {r['bound']} |"
            )
    return "\n".join(lines)


def plot_roofline(report: dict[str, Any], path: Path) -> None:
    """Log-log roofline: the measured roofs and one point per operator and phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = report["bounds"]
    bw, peak = b["bandwidth_gb_s"], b["peak_gflop_s"]
    points = [
        (ph, r)
        for ph, data in report["phases"].items()
        for r in data["ops"]
        if r["name"] != "other" and r["flops"] > 0 and r["seconds"] > 0
    ]
    xs = [r["intensity_flop_per_byte"] for _, r in points] + [b["ridge_flop_per_byte"]]
    lo, hi = min(xs) / 3, max(xs) * 3
    fig, ax = plt.subplots(figsize=(8, 5.5))
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak, x * bw) for x in grid], "k-", lw=1.5, label="roofline (measured)")
    ax.axvline(b["ridge_flop_per_byte"], color="grey", ls=":", lw=1)
    style = {"prefill": ("o", "tab:blue"), "decode": ("^", "tab:red")}
    for phase in report["phases"]:
        sel = [r for ph, r in points if ph == phase]
        marker, color = style.get(phase, ("s", "tab:green"))
        ax.scatter(
            [r["intensity_flop_per_byte"] for r in sel],
            [r["achieved_gflop_s"] for r in sel],
            marker=marker, color=color, label=phase, zorder=3,
        )  # fmt: skip
        for r in sel:
            ax.annotate(
                r["name"], (r["intensity_flop_per_byte"], r["achieved_gflop_s"]),
                textcoords="offset points", xytext=(4, 3), fontsize=7, color=color,
            )  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(
        f"{report['model']} {report['dtype']} KV {report['kv_cache_dtype']}, batch "
        f"{report['batch']} x {report['context']}: {bw:.0f} GB/s, {peak:.0f} GFLOP/s",
        fontsize=9,
    )
    ax.text(
        b["ridge_flop_per_byte"], peak * 1.1, " memory-bound | compute-bound",
        ha="center", fontsize=8, color="grey",
    )  # fmt: skip
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
