"""What watching the cache costs: output tok/s of a real ``kvstack serve`` with one
scripted ``/v1/kv/state`` reader against none (what
watching the web view costs the engine; ``docs/serving/openai.md``).

One server process (the default model unless ``--model``), a batch of ``--concurrency``
streaming completions of ``--max-tokens`` tokens each (``ignore_eos``) per run; runs
alternate between "no viewer" and "one viewer" (``--pairs`` pairs, the first of each
pair swapped every other time), and the medians of each arm are compared. The viewer
is a thread that reads the state stream at ``--interval-ms`` (250 ms: the fastest the
server allows) and parses every frame, as the page does; a browser would share the
CPU cores with the server, so the benchmark uses the script.

Prints the CPU model and ISA flags; writes ``benchmarks/results/kv_view_overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench_common import RESULTS_DIR, log, median, write_json
from offline_throughput import machine_info

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_util import ServerProcess

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides home."


async def one_batch(url: str, concurrency: int, max_tokens: int) -> tuple[float, int]:
    """Seconds and output tokens of ``concurrency`` concurrent streamed completions."""
    body = {
        "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        "temperature": 0, "stream_options": {"include_usage": True},
    }  # fmt: skip

    async def one(ac: httpx.AsyncClient, i: int) -> int:
        tokens = 0
        req = {**body, "prompt": f"{PROMPT} ({i})"}
        async with ac.stream("POST", url + "/v1/completions", json=req) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
        return tokens

    async with httpx.AsyncClient(timeout=600) as ac:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(ac, i) for i in range(concurrency)))
        return time.perf_counter() - t0, sum(counts)


class Viewer:
    """A thread reading ``/v1/kv/state`` and parsing each frame until ``stop``."""

    def __init__(self, url: str, interval_ms: int) -> None:
        self.url = f"{url}/v1/kv/state?interval_ms={interval_ms}"
        self.frames = 0
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.stream("GET", self.url, timeout=60) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    self.frames += 1
                    self.bytes += len(line)
                if self._stop.is_set():
                    return

    def __enter__(self) -> Viewer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while self.frames == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="--model for kvstack serve (default: its own)")
    p.add_argument("--concurrency", type=int, default=8, help="requests per run (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens each (default 64)")
    p.add_argument("--pairs", type=int, default=5, help="viewer / no-viewer pairs (default 5)")
    p.add_argument("--interval-ms", type=int, default=250, help="viewer's interval (250)")
    p.add_argument("--out", default=str(RESULTS_DIR / "kv_view_overhead.json"))
    a = p.parse_args()
    info = machine_info()
    flags = " ".join(info.get("cpu_flags", [])) or "none of avx2/avx512/amx"
    log(f"CPU: {info.get('cpu_model')} ({info.get('cpu_count')} cores); ISA flags: {flags}")
    args = ["--max-num-seqs", str(a.concurrency)] + (["--model", a.model] if a.model else [])
    runs: dict[str, list[float]] = {"none": [], "viewer": []}
    frames: list[int] = []
    with tempfile.TemporaryDirectory() as d, ServerProcess(args, Path(d) / "server.log") as srv:
        asyncio.run(one_batch(srv.url, a.concurrency, 8))  # warm-up
        for i in range(a.pairs):
            order = ["none", "viewer"] if i % 2 == 0 else ["viewer", "none"]
            for arm in order:
                if arm == "viewer":
                    with Viewer(srv.url, a.interval_ms) as v:
                        dt, n = asyncio.run(one_batch(srv.url, a.concurrency, a.max_tokens))
                    frames.append(v.frames)
                else:
                    dt, n = asyncio.run(one_batch(srv.url, a.concurrency, a.max_tokens))
                runs[arm].append(n / dt)
                log(f"pair {i + 1}/{a.pairs} {arm:>6}: {n} tokens, {dt:.2f} s, {n / dt:.1f} tok/s")
    none, viewer = median(runs["none"]), median(runs["viewer"])
    paired = [v / n for v, n in zip(runs["viewer"], runs["none"], strict=True)]
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": info,
        "model": a.model or "default (kvstack serve's)",
        "concurrency": a.concurrency, "max_tokens": a.max_tokens, "pairs": a.pairs,
        "interval_ms": a.interval_ms,
        "tok_s": runs, "median_tok_s": {"none": none, "viewer": viewer},
        "ratio_of_medians": viewer / none, "median_paired_ratio": median(paired),
        "paired_ratios": paired, "viewer_frames_per_run": frames,
    }  # fmt: skip
    write_json(result, a.out)
    ratio, pr = viewer / none, median(paired)
    log(f"median tok/s: no viewer {none:.1f}, one viewer {viewer:.1f} (ratio {ratio:.3f}, ")
    log(f"median paired ratio {pr:.3f}); wrote {a.out}")


if __name__ == "__main__":
    main()
