"""Engine processes of ``offline_throughput.py``: one per engine, alone or paired.

``run_peer`` runs one engine's measurement in its own process (the peer's venv, vLLM's
environment). ``run_paired`` starts all of a case's engines at once and lets them take
turns (``benchmarks/turns.py``): they load and warm up side by side, then timed runs
alternate, so each pair of runs sees the same machine. Standard library only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_common import BENCH_VENVS, REPO_ROOT, log, venv_python

OFFLINE_SCRIPT = REPO_ROOT / "benchmarks" / "offline_throughput.py"


def peer_command(peer: str, request: Path, out: Path) -> tuple[list[str], dict[str, str]]:
    """Command line and environment that run ``peer`` on a request file."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    bench = str(REPO_ROOT / "benchmarks")
    if peer == "kvstack":
        cmd = [
            sys.executable,
            str(OFFLINE_SCRIPT),
            "--worker-request",
            str(request),
            "--worker-out",
            str(out),
        ]
        return cmd, env
    python = venv_python(peer)
    if not python.exists():
        raise FileNotFoundError(f"{python} missing: run bash benchmarks/setup_peers.sh")
    if peer == "vllm":
        sys.path.insert(0, bench)
        from peers import VLLM_ENV

        env.update(VLLM_ENV)
        env.pop("OMP_NUM_THREADS", None)
        iomp = BENCH_VENVS / "vllm" / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    return [
        str(python),
        f"{bench}/peers.py",
        "run",
        "--request",
        str(request),
        "--out",
        str(out),
    ], env


def run_peer(
    peer: str,
    request: dict[str, Any],
    timeout_s: float,
    log_path: Path,
    extra_env: dict[str, str] | None = None,
) -> dict:
    """Run one engine in its own process; return its result or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        req_path, out_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps({"peer": peer, **request}))
        cmd, env = peer_command(peer, req_path, out_path)
        env.update(extra_env or {})
        log(f"[{peer}] starting (timeout {timeout_s:.0f} s, log {log_path})")
        t0 = time.perf_counter()
        with log_path.open("w") as logf:
            try:
                proc = subprocess.run(
                    cmd,
                    env=env,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    cwd=REPO_ROOT,
                    check=False,
                )
                rc: int | str = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        elapsed = time.perf_counter() - t0
        if rc == 0 and out_path.exists():
            result = json.loads(out_path.read_text())
            result["process_s"] = round(elapsed, 1)
            log(f"[{peer}] done in {elapsed:.0f} s: {result['output_tok_s']} output tok/s")
            return result
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    log(f"[{peer}] FAILED ({rc}) after {elapsed:.0f} s; last lines of {log_path}:")
    for line in tail:
        log(f"    {line}")
    return {"peer": peer, "error": f"exit {rc}", "process_s": round(elapsed, 1), "log_tail": tail}


def run_paired(
    peers: list[str], requests: dict[str, dict[str, Any]], timeout_s: float, logs: dict[str, Path]
) -> list[dict]:
    """All ``peers`` at once, taking turns (order: ``peers``); results in that order."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvbench-turns-") as turns:
        base = {"KVBENCH_TURNS": turns, "KVBENCH_ORDER": ",".join(peers)}

        def one(peer: str) -> None:
            try:
                env = {**base, "KVBENCH_PEER": peer}
                results[peer] = run_peer(peer, requests[peer], timeout_s, logs[peer], env)
            finally:  # a crashed peer must not keep the others waiting for its turn
                (Path(turns) / f"gone-{peer}").touch()

        threads = [threading.Thread(target=one, args=(p,)) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return [results[p] for p in peers]


def paired_ratios(results: list[dict], ref: str = "vllm") -> None:
    """Per run pair, each engine's output tok/s over ``ref``'s (same turn): stored as
    ``paired_ratios_vs_<ref>`` and their median ``paired_ratio_vs_<ref>``."""
    by_peer = {r["peer"]: r for r in results if "error" not in r}
    base = by_peer.get(ref)
    if base is None:
        return
    for r in by_peer.values():
        if r is base:
            continue
        ratios = [b / w for w, b in zip(r["wall_s"], base["wall_s"], strict=False)]
        if ratios:
            r[f"paired_ratios_vs_{ref}"] = [round(x, 3) for x in ratios]
            r[f"paired_ratio_vs_{ref}"] = round(sorted(ratios)[len(ratios) // 2], 3)
