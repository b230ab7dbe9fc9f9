"""Arithmetic and output of ``kvstack eval`` (``kvstack.tools.eval``): metrics, table, plot.

* :func:`compare_logprobs`: KL(baseline || variant) in nats, top-1 agreement and
  perplexities from two ``[n, vocab]`` log-probability matrices, in float32 chunks;
* :func:`greedy_agreement`: identical positions and identical prefix of two greedy runs;
* :func:`aggregate_quality`, :func:`summary_rows`: per-variant summaries of the raw numbers;
* :func:`format_table`, :func:`format_markdown`, :func:`write_plot`, :func:`write_json`.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstack.core.errors import ConfigError
from kvstack.model.kernels import isa

if TYPE_CHECKING:
    import torch

CHUNK_ROWS = 256  # rows of the [n, vocab] matrices converted to float32 at a time


# ---------------------------------------------------------------------------- metrics


def compare_logprobs(
    base: torch.Tensor, other: torch.Tensor, targets: torch.Tensor | None = None
) -> dict[str, Any]:
    """KL(base || other) per row (nats), top-1 agreement and the NLL of ``targets``.

    ``base`` and ``other`` are ``[n, vocab]`` log-probabilities (any float dtype). Rows
    are compared ``CHUNK_ROWS`` at a time in float32, each renormalized first (fp16
    rounding leaves a distribution off by ~1e-3), so KL is >= 0 and exactly 0 for
    identical inputs. ``targets[i]`` is the token row ``i`` predicts.
    """
    import torch

    if base.shape != other.shape or base.dim() != 2:
        raise ValueError(f"shape mismatch {tuple(base.shape)} vs {tuple(other.shape)}")
    n = base.shape[0]
    kl_sum = kl_max = 0.0
    agree = 0
    nll_b = nll_o = 0.0
    for i in range(0, n, CHUNK_ROWS):
        p = torch.log_softmax(base[i : i + CHUNK_ROWS].float(), -1)
        q = torch.log_softmax(other[i : i + CHUNK_ROWS].float(), -1)
        pe = p.exp()
        terms = torch.where(pe > 0, pe * (p - q), torch.zeros((), dtype=p.dtype))
        kl = terms.sum(-1).clamp_min(0.0)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        if targets is not None:
            t = targets[i : i + CHUNK_ROWS].long().unsqueeze(-1)
            nll_b -= float(p.gather(-1, t).sum())
            nll_o -= float(q.gather(-1, t).sum())
    out: dict[str, Any] = {
        "tokens": n,
        "kl_sum": kl_sum,
        "kl_mean": kl_sum / n if n else 0.0,
        "kl_max": kl_max,
        "top1_agree": agree,
        "top1_agreement": agree / n if n else 1.0,
    }
    if targets is not None:
        out.update(nll_baseline_sum=nll_b, nll_variant_sum=nll_o)
        out.update(_ppl(nll_b, nll_o, n))
    return out


def _ppl(nll_b: float, nll_o: float, n: int) -> dict[str, float]:
    return {
        "ppl_baseline": math.exp(nll_b / n) if n else 1.0,
        "ppl_variant": math.exp(nll_o / n) if n else 1.0,
    }


def aggregate_quality(per_text: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Token-weighted totals of :func:`compare_logprobs` results (one per text)."""
    n = sum(r["tokens"] for r in per_text)
    kl = sum(r["kl_sum"] for r in per_text)
    agree = sum(r["top1_agree"] for r in per_text)
    out: dict[str, Any] = {
        "tokens": n,
        "kl_mean": kl / n if n else 0.0,
        "kl_max": max((r["kl_max"] for r in per_text), default=0.0),
        "top1_agreement": agree / n if n else 1.0,
    }
    if per_text and all("nll_baseline_sum" in r for r in per_text):
        nb = sum(r["nll_baseline_sum"] for r in per_text)
        no = sum(r["nll_variant_sum"] for r in per_text)
        out.update(_ppl(nb, no, n))
    return out


def greedy_agreement(base: Sequence[int], other: Sequence[int]) -> dict[str, float]:
    """Share of positions where ``other`` has ``base``'s token, and the identical prefix."""
    n = max(len(base), len(other))
    if n == 0:
        return {"identical_fraction": 1.0, "identical_prefix": 0}
    same = sum(a == b for a, b in zip(base, other, strict=False))
    prefix = 0
    for a, b in zip(base, other, strict=False):
        if a != b:
            break
        prefix += 1
    return {"identical_fraction": same / n, "identical_prefix": prefix}


def mean(xs: Iterable[float]) -> float:
    vals = list(xs)
    return sum(vals) / len(vals) if vals else 0.0


def greedy_summary(per_text: Sequence[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """Mean identical fraction and identical prefix over texts (``greedy_agreement``)."""
    return {
        "identical_fraction": mean(r["identical_fraction"] for r in per_text),
        "identical_prefix_mean": mean(r["identical_prefix"] for r in per_text),
        "tokens": tokens,
    }


def needle_summary(
    raw: Sequence[dict[str, Any]], lengths: Sequence[int], depths: Sequence[float]
) -> dict[str, Any]:
    """Accuracy overall and per (length, depth) cell of needle results (``correct`` flags)."""
    cells = []
    for n in lengths:
        for d in depths:
            hits = [r["correct"] for r in raw if r["length"] == n and r["depth"] == d]
            cells.append({"length": n, "depth": d, "accuracy": mean(hits), "n": len(hits)})
    correct = sum(bool(r["correct"]) for r in raw)
    return {
        "accuracy": correct / len(raw) if raw else 0.0,
        "correct": correct,
        "total": len(raw),
        "by_cell": cells,
    }


def needle_calibration(baseline: dict[str, Any]) -> dict[str, Any]:
    """The needle task's calibration measured in this run: the uncompressed baseline's
    accuracy overall and per prompt length (a needle a variant misses only counts if the
    baseline finds it)."""
    nd = baseline["needle"]
    by_length: dict[str, dict[str, Any]] = {}
    for r in baseline["raw"]["needle"]:
        cell = by_length.setdefault(str(r["length"]), {"correct": 0, "total": 0})
        cell["correct"] += bool(r["correct"])
        cell["total"] += 1
    for cell in by_length.values():
        cell["accuracy"] = cell["correct"] / cell["total"]
    return {
        "variant": baseline["label"],
        "accuracy": nd["accuracy"],
        "correct": nd["correct"],
        "total": nd["total"],
        "by_length": by_length,
    }


def model_info(mc: Any) -> dict[str, Any]:
    """The model's name and the shapes that decide its KV size (a ``ModelConfig``)."""
    return {
        "name": mc.name,
        "layers": mc.num_layers,
        "kv_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "max_context": mc.max_position_embeddings,
    }


def machine_info() -> dict[str, Any]:
    """Where the numbers came from (speed depends on it)."""
    import torch

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_model": _cpu_model(),
        "commit": _commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    """The CPU's marketing name (``model/kernels/isa.py``: ``/proc/cpuinfo``, else the
    platform's)."""
    return isa.cpu_model()


def _commit() -> str | None:
    """The kvstack source's git commit (``+dirty`` with uncommitted changes), or None
    outside a git checkout."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


# ---------------------------------------------------------------------------- table


COLUMNS = (
    "variant",
    "B/token",
    "tokens in {mem} (× bf16)",
    "KV removed",
    "KL (nats)",
    "top-1",
    "greedy identical",
    "needle acc",
    "decode tok/s (× auto)",
    "decode-only tok/s",
)


def _mem(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row of strings per variant (the baseline first), in :data:`COLUMNS` order."""
    rows = []
    for r in report["results"]:
        q, g, nd, sp = r["quality"], r["greedy"], r["needle"], r["speed"]
        rows.append(
            [
                r["label"],
                f"{r['bytes_per_token']:,.0f}" + _held(r, "bytes_per_token"),
                f"{r['tokens_in_memory']:,} ({r['capacity_ratio']:.2f}×)"
                + _held(r, "tokens_in_memory"),
                _removed(r),
                f"{q['kl_mean']:.4f}",
                f"{q['top1_agreement']:.3f}",
                f"{g['identical_fraction']:.3f} (prefix {g['identical_prefix_mean']:.1f})",
                f"{nd['accuracy']:.2f} ({nd['correct']}/{nd['total']})",
                f"{sp['output_tok_s']:.1f} ({sp['ratio_to_baseline']:.2f}×)",
                f"{sp['decode_tok_s']:.1f}",
            ]
        )
    return rows


def _held(r: dict[str, Any], key: str) -> str:
    """With sliding-window layers (hybrid KV manager): what sequences of the longest
    context hold, next to the one-table figure."""
    held = r.get("held")
    return "" if held is None else f"; {held[key]:,.0f} held at {held['context']:,}"


def _removed(r: dict[str, Any]) -> str:
    """Share of the pressed KV a press really removed (blocks reclaimed per request)."""
    p = r.get("press")
    if not p or not p["input_tokens"]:
        return "–"
    return f"{p['removed_fraction']:.2f} ({p['reclaimed_blocks_per_request']:.1f} blk)"


def _headers(report: dict[str, Any]) -> list[str]:
    mem = _mem(int(report["config"]["memory"]))
    return [c.format(mem=mem) for c in COLUMNS]


def format_table(report: dict[str, Any]) -> str:
    """Plain-text table plus a few lines on what was measured."""
    headers, rows = _headers(report), summary_rows(report)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [_caption(report), "", line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return "\n".join(out)


def _caption(report: dict[str, Any]) -> str:
    c = report["config"]
    base = report["results"][0]
    return (
        f"kvstack eval: {report['model']['name']} ({c['dtype']}), baseline {base['label']}; "
        f"quality on {base['quality']['tokens']} teacher-forced tokens of "
        f"{len(report['corpus']['texts'])} text(s) ({report['corpus']['kind']}), "
        f"{c['greedy_tokens']} greedy tokens per text, needle lengths "
        f"{','.join(map(str, c['needle_lengths']))} x depths "
        f"{','.join(map(str, c['needle_depths']))} x {c['needle_trials']} keys"
        f"{_calibration(report)}, decode batch {c['batch']}; {report['wall_s']:.0f} s"
    )


def _calibration(report: dict[str, Any]) -> str:
    """`` (baseline finds 9/9)``: the needle calibration this run measured."""
    cal = report.get("needle_task", {}).get("calibration")
    if not cal:
        return ""
    return f" (the baseline finds {cal['correct']}/{cal['total']})"


def format_markdown(report: dict[str, Any]) -> str:
    """The same table as GitHub markdown, with the caption as a paragraph above it."""
    headers, rows = _headers(report), summary_rows(report)
    out = [_caption(report), "", "| " + " | ".join(headers) + " |"]
    out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|")
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------- files


def write_json(report: dict[str, Any], path: str | Path) -> None:
    try:
        Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write {str(path)!r}: {e.strerror}") from None


def write_text(text: str, path: str | Path) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write {str(path)!r}: {e.strerror}") from None


def check_plot_available() -> None:
    """Raise ``ConfigError`` now (before minutes of work) if matplotlib is missing."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed (pip install matplotlib, "
            "or kvstack[test])"
        ) from e
    return plt


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """Quality vs memory: effective KV bytes per prompt token on x (a press's share of
    removed KV counted), top-1 agreement and KL in two panels; presses in orange."""
    plt = _pyplot()
    res = report["results"]
    xs = [r["bytes_per_token"] * (1 - (r.get("press") or {}).get("removed_fraction", 0.0))
          for r in res]  # fmt: skip
    colors = ["tab:orange" if r.get("press") else "tab:blue" for r in res]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in (
        (ax1, "top1_agreement", "top-1 agreement with baseline"),
        (ax2, "kl_mean", "mean KL(baseline || variant), nats"),
    ):
        ys = [r["quality"][key] for r in res]
        ax.scatter(xs, ys, c=colors, zorder=3)
        near = 0.15 * (max(xs) - min(xs) or 1.0)
        for r, x, y in zip(res, xs, ys, strict=True):
            # neighbours in x alternate above / below, top down, so labels do not collide
            higher = sum(abs(x2 - x) < near and y2 > y for x2, y2 in zip(xs, ys, strict=True))
            below = higher % 2 == 1
            ax.annotate(
                r["label"] if r.get("press") else f"{r['label']} ({r['capacity_ratio']:.2f}×)",
                (x, y),
                textcoords="offset points",
                xytext=(5, -13 if below else 6),
                fontsize=9,
            )
        ax.margins(x=0.2, y=0.1)
        ax.set_xlabel("KV bytes per prompt token kept (all layers)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax2.set_yscale("symlog", linthresh=1e-4)
    ax1.set_ylim(min(0.5, *(r["quality"]["top1_agreement"] for r in res)) - 0.02, 1.02)
    fig.suptitle(
        f"kvstack eval: {report['model']['name']} — quality vs KV memory "
        f"(labels: tokens in the same memory vs {res[0]['label']})"
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise ConfigError(f"cannot write plot {str(path)!r}: {e.strerror}") from None
    finally:
        plt.close(fig)
