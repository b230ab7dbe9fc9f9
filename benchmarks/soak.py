"""The fault suite's long soak (the threat model: SECURITY.md): a real ``kvstack serve`` on
loopback under every attack at once.

Runs ``kvstack.testing.soak.run_soak`` (the attacks and the fault timeline are described
there and in ``kvstack.testing.soak_attacks``): a baseline phase of well-behaved clients,
then ``--rounds`` attack rounds (RSS measured after each: growth that continues round
after round is a leak, a first-round rise is warm-up), a router over the server and a
second backend that is SIGKILLed mid-stream, Redis killed and restarted, the disk tier
corrupted and made unwritable, the request log on ``/dev/full``. Bounded: about
``baseline + rounds x attack`` seconds plus start-up (three processes) and the drains.

Writes ``benchmarks/results/soak-<date>.json`` (the report, the commit and the CPU) and
prints the README's table.

    .venv/bin/python benchmarks/soak.py                 # default model, ~2.5 minutes
    .venv/bin/python benchmarks/soak.py --tiny --attack-s 10 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import REPO_ROOT, RESULTS_DIR, find_gguf
from kvstack.testing.soak import SoakConfig, run_soak
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_gguf


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=False)  # fmt: skip
    return out.stdout.strip() or "unknown"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def table(r: dict[str, Any]) -> str:
    """The README table of one report."""
    att = r["outcomes"]["attack"]
    rows = [("requests by kind and status (attack phases)", "")]
    for kind, seen in att.items():
        rows.append((f"  {kind}", ", ".join(f"{s}: {n}" for s, n in seen.items())))
    rss = r["rss_mb"]
    rows += [
        ("good clients p50, baseline / attack",
         f"{_fmt(r['good_p50_s']['baseline'])} / {_fmt(r['good_p50_s']['attack'])}"),
        ("good clients p99, baseline / attack",
         f"{_fmt(r['good_p99_s']['baseline'])} / {_fmt(r['good_p99_s']['attack'])}"),
        ("/health probes (all 200) / slowest",
         f"{r['health']['probes']} ({r['engine_alive_throughout']}) / "
         f"{r['health']['slowest_s']:.2f} s"),
        ("KV blocks leaked (check_integrity at exit)",
         f"{r['kv_blocks_leaked']} of {r['kv_blocks_total']} ({r['kv_integrity_at_exit']})"),
        ("KV usage when idle", f"{r['kv_usage_idle']:.3f}"),
        ("RSS after baseline / each attack round",
         f"{rss['after_baseline']} / {' / '.join(map(str, rss['after_each_attack_round']))} MiB"),
        ("internal errors / tier errors / corrupt blocks caught",
         f"{r['internal_errors']:.0f} / {r['offload_errors']:.0f} / "
         f"{r['offload_corrupt_blocks']:.0f}"),
        ("faults injected", "; ".join(r["chaos"])),
        ("server exit status", str(r["exit_code"])),
    ]  # fmt: skip
    lines = [f"Commit {r['commit']}, {r['cpu']}, model {r['model_name']}, "
             f"{r['config']['good_clients']} good clients, {r['config']['streams']} attack "
             f"streams, {r['config']['attack_rounds']} x {r['config']['attack_s']:.0f} s "
             f"attack after {r['config']['baseline_s']:.0f} s baseline "
             f"(`benchmarks/soak.py`, {time.strftime('%Y-%m-%d', time.gmtime())}).", "",
             "| | |", "|---|---|"]  # fmt: skip
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random model, not SmolLM2")
    p.add_argument("--baseline-s", type=float, default=20.0)
    p.add_argument("--attack-s", type=float, default=45.0, help="seconds per attack round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--no-router", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvstack-soak-"))
    args: tuple[str, ...] = ("--max-model-len", "1024")
    if a.tiny:
        cfg = tiny_llama_config()
        model = work / "tiny.gguf"
        write_gguf(model, cfg, random_llama_weights(cfg))
        args = ("--dtype", "float32", "--num-blocks", "512")
    else:
        model = find_gguf()
    report = run_soak(SoakConfig(
        model=str(model), workdir=work, baseline_s=a.baseline_s, attack_s=a.attack_s,
        attack_rounds=a.rounds, streams=a.streams, router=not a.no_router, server_args=args,
    ))  # fmt: skip
    report.update(commit=git_commit(), cpu=cpu_model(), model_name=model.name)
    out = a.out or RESULTS_DIR / f"soak-{time.strftime('%Y%m%d')}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    print(f"\nwrote {out}")
    ok = report["kv_blocks_leaked"] == 0 and report["engine_alive_throughout"]
    return 0 if ok and report["exit_code"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
