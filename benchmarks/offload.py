"""KV offload tiers: time to first token when a shared prefix's KV comes from a tier.

Per prefix length N, one request = the prefix (seeded prose, exactly N tokens) + a fresh
16-token suffix, ``max_tokens=1``, default model; each length runs once untimed first.

  recompute     no tiers, device prefix cache emptied before the request: full prefill
  device        the prefix already in the device cache (prefix reuse's reference)
  host          ``kv_offload="host:2GiB"``; the prefix stored (write-through, flushed), the
                device cache emptied before each request
  disk          the same with ``disk:<tmpdir>:8GiB``; the files were just written, so they
                are read from the OS page cache
  disk-restart  per run the disk LLM is shut down and rebuilt over the same directory (the
                tier rescans it), then every length is timed once
  redis         the same with a throwaway ``redis-server`` (``LocalRedis``, maxmemory 2gb)

The script fails unless a request's hit is its N // block_size prefix blocks from the
expected source (``cached_tokens_by_tier``). TTFT = wall time of ``generate``, medians of
``--runs`` (a request during which other processes used > 0.1 core is repeated); speedup =
recompute / mode; MiB loaded and GB/s from the tier's ``TierStats`` deltas (the I/O time
inside its lookup, without staging or the copy into the device pool). Results go to
``benchmarks/results/offload-<date>.json`` and ``.png``; ``--write-readme`` then
re-renders the docs' measured tables from the results (``benchmarks/docs_tables.py``).

    .venv/bin/python benchmarks/offload.py [--quick] [--modes host,disk] [--lengths 64,4000]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench_common import (
    RESULTS_DIR,
    LoadMeter,
    log,
    median,
    render_docs,
    wait_for_idle,
    write_json,
)
from kvstack import LLM, SamplingParams
from offline_throughput import machine_info

MODES = ("recompute", "device", "host", "disk", "disk-restart", "redis")
TIER = {"host": "host", "disk": "disk", "disk-restart": "disk", "redis": "redis"}
SUFFIX_LEN = 16
MAX_OTHER_LOAD = 0.1  # cores other processes may use during a timed request
ONE_TOKEN = SamplingParams(max_tokens=1)
GBS = "GB/s = bytes / (TTFT - device TTFT), in parentheses bytes / time inside the tier's lookup"
DISK = "disk files read from the OS page cache (just written)"
Medians = dict[str, dict[int, dict[str, float]]]


class Bench:
    """Prompts, LLM construction and the timed request, shared by every mode."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvstack.model.loader.registry import load_tokenizer
        from kvstack.tools.workloads.text import TextMaker

        self.args, self.maker = args, TextMaker(load_tokenizer("default"))
        self.prefixes = {n: self._text(random.Random(n), n) for n in args.lengths}
        self._seed, self.server_pid = 10**6, 0  # redis-server: its CPU is not others' load
        self.samples: list[dict[str, Any]] = []
        self.discarded: list[dict[str, Any]] = []

    def _text(self, rng: random.Random, n: int) -> list[int]:
        ids = self.maker.tok.encode(self.maker.text(rng, n + 32), add_special_tokens=False)
        assert len(ids) >= n, f"text of {len(ids)} tokens for {n}"
        return ids[:n]

    def prompt(self, n: int) -> list[int]:
        """The length-``n`` prefix plus a suffix no other request has."""
        self._seed += 1
        return self.prefixes[n] + self._text(random.Random(self._seed), SUFFIX_LEN)

    def llm(self, offload: str | None) -> LLM:
        gc.collect()  # frees the previous LLM's KV pool first
        llm = LLM("default", dtype=self.args.dtype, kv_offload=offload)
        warm = self._text(random.Random(-1), 48)
        llm.generate(
            prompt_token_ids=[warm], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
        )
        return llm

    def prime(self, llm: LLM, n: int) -> None:
        """Compute the prefix once, untimed, so the device cache and the tier hold it."""
        llm.generate(prompt_token_ids=[self.prompt(n)], sampling_params=ONE_TOKEN, use_tqdm=False)
        if llm.engine.connector is not None:
            llm.engine.connector.offload.flush()

    def timed(self, llm: LLM, mode: str, n: int, run: int) -> None:
        """Time one request, repeated (``--retries``) while other processes were busy."""
        for attempt in range(self.args.retries + 1):
            s = self.once(llm, mode, n, run)
            if s["other_load_cores"] <= MAX_OTHER_LOAD or attempt == self.args.retries:
                break
            log("  machine busy: repeated")
            self.discarded.append(s)
        self.samples.append(s)

    def once(self, llm: LLM, mode: str, n: int, run: int) -> dict[str, Any]:
        """One timed request; fails unless its cache hit came from the expected place."""
        tier, conn = TIER.get(mode), llm.engine.connector
        if mode != "device":
            if conn is not None:
                conn.offload.flush()  # earlier requests' stores, outside the timing
            llm.reset_prefix_cache()
        if self.args.wait_idle > 0:
            wait_for_idle(self.args.wait_idle)
        before = llm.get_stats().offload.get(tier or "")
        ids = self.prompt(n)
        with LoadMeter() as meter:
            t0, server0 = time.perf_counter(), proc_cpu(self.server_pid)
            out = llm.generate(prompt_token_ids=[ids], sampling_params=ONE_TOKEN, use_tqdm=False)[0]
            wall, server = time.perf_counter() - t0, proc_cpu(self.server_pid) - server0
        if out.error or len(out.outputs[0].token_ids) != 1:
            raise RuntimeError(f"{mode} {n}: request failed: {out.error}")
        bs, by_tier = llm.engine.kv_manager.block_size, dict(out.cached_tokens_by_tier or {})
        ttft = out.metrics.ttft if out.metrics else None
        s: dict[str, Any] = dict(mode=mode, length=n, run=run, wall_ms=wall * 1e3)
        s.update(ttft_ms=None if ttft is None else ttft * 1e3, cached_by_tier=by_tier)
        other = max(meter.other_cores - server / wall, 0)
        s.update(cached_tokens=out.num_cached_tokens, other_load_cores=other)
        expect = 0 if mode == "recompute" else n // bs * bs
        got = by_tier.get(tier, 0) if tier else out.num_cached_tokens
        if got != expect or out.num_cached_tokens != expect or (tier and by_tier.get("device")):
            src = f"{tier or 'device'}, got {out.num_cached_tokens} {by_tier}"
            raise RuntimeError(f"{mode} {n}: expected {expect} cached tokens from {src}")
        if tier and conn is not None and before is not None:
            after = llm.get_stats().offload[tier]
            s["bytes_loaded"] = after.bytes_loaded - before.bytes_loaded
            s["io_ms"] = (after.load_latency_sum - before.load_latency_sum) * 1e3
            s["payload_bytes"] = expect // bs * conn.offload.layout.payload_bytes
            if s["bytes_loaded"] != s["payload_bytes"]:
                log(f"  note: {tier} loaded {s['bytes_loaded']} B, expected {s['payload_bytes']}")
        log(f"  {mode:12} {n:5} tokens run {run}: {s['wall_ms']:8.1f} ms, cached {by_tier or got}")
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}


def proc_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has used (0 for pid 0 or when unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_all(b: Bench, modes: list[str]) -> None:
    """Every selected mode, length and run; the samples accumulate in ``b.samples``."""
    if {"recompute", "device"} & set(modes):
        llm = b.llm(None)
        for n in b.args.lengths:
            b.prime(llm, n)  # warms this length's shapes; the device then holds the prefix
            for mode in ("device", "recompute"):
                for r in range(b.args.runs if mode in modes else 0):
                    b.timed(llm, mode, n, r)
        llm.shutdown()
        del llm
    tmp = tempfile.mkdtemp(prefix="kvstack-offload-bench-")
    try:
        for tier in ("host", "disk", "redis"):
            if todo := [m for m in modes if TIER.get(m) == tier]:
                with contextlib.ExitStack() as stack:
                    spec = {"host": "host:2GiB", "disk": f"disk:{tmp}:8GiB"}.get(tier, "")
                    if tier == "redis":
                        from kvstack.testing.redis_server import LocalRedis

                        os.environ["KVSTACK_REDIS_MAXMEMORY"] = "2gb"
                        server = stack.enter_context(LocalRedis())
                        spec, b.server_pid = server.url, server.proc.pid if server.proc else 0
                    run_tier(b, spec, todo)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_tier(b: Bench, spec: str, todo: list[str]) -> None:
    """One tier's modes: prime each prefix and time it; for disk also after restarts."""
    llm = b.llm(spec)
    for n in b.args.lengths:
        b.prime(llm, n)
        for r in range(b.args.runs if todo[0] != "disk-restart" else 0):
            b.timed(llm, todo[0], n, r)
    for r in range(b.args.runs if "disk-restart" in todo else 0):
        llm.shutdown()  # writes what is queued; the files stay
        del llm
        llm = b.llm(spec)  # a new engine over the same directory
        for n in b.args.lengths:
            b.timed(llm, "disk-restart", n, r)
    llm.shutdown()


def summarize(samples: list[dict[str, Any]]) -> Medians:
    """Medians per mode and length, with the speedup vs recompute and the I/O bandwidth."""
    med: Medians = {}
    for mode in MODES:
        for n in sorted({s["length"] for s in samples if s["mode"] == mode}):
            rows = [s for s in samples if s["mode"] == mode and s["length"] == n]
            keys = ("wall_ms", "ttft_ms", "cached_tokens", "bytes_loaded", "io_ms")
            m = {k: median([r[k] for r in rows]) for k in keys if rows[0].get(k) is not None}
            if m.get("io_ms"):
                m["io_gb_s"] = m["bytes_loaded"] / m["io_ms"] / 1e6
            med.setdefault(mode, {})[n] = m
    rec, dev = med.get("recompute", {}), med.get("device", {})
    for by_len in med.values():
        for n, m in by_len.items():
            if n in rec:
                m["speedup"] = rec[n]["wall_ms"] / m["wall_ms"]
            if n in dev and m.get("bytes_loaded"):  # the tier's cost over a device hit
                m["ms_over_device"] = m["wall_ms"] - dev[n]["wall_ms"]
                if m["ms_over_device"] > 0:
                    m["eff_gb_s"] = m["bytes_loaded"] / m["ms_over_device"] / 1e6
            by_len[n] = {k: round(v, 3) for k, v in m.items()}
    return med


def break_even(med: Medians) -> dict[str, dict[str, Any]]:
    """Per mode: the smallest length faster than recompute; whether every length is."""
    rec, out = med.get("recompute", {}), {}
    for mode in (m for m in med if m != "recompute" and rec):
        wins = [n for n, v in med[mode].items() if n in rec and v["wall_ms"] < rec[n]["wall_ms"]]
        out[mode] = dict(first_length_faster=min(wins, default=None), faster_at_all=wins == [*rec])
    return out


def verdict(v: dict[str, Any]) -> str:
    if v["faster_at_all"]:
        return "at every length"
    first = v["first_length_faster"]
    return "never" if first is None else f"from {first} tokens"


def markdown(doc: dict[str, Any]) -> str:
    """Rows: prefix lengths; TTFT ms (speedup) per mode, MiB loaded, GB/s (``GBS``) per tier."""
    med, bev = doc["medians"], doc["break_even"]
    tiers = [m for m in med if m in TIER]
    head = ["prefix tokens", *med, "MiB loaded", *(f"{m} GB/s" for m in tiers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for n in sorted({n for v in med.values() for n in v}):
        row = [str(n)]
        for m, v in ((m, med[m].get(n)) for m in med):
            sp = f" ({v['speedup']:.2f}×)" if v and "speedup" in v and m != "recompute" else ""
            row.append(f"{v['wall_ms']:.1f}{sp}" if v else "–")
        mib = [med[m][n]["bytes_loaded"] / 2**20 for m in tiers if n in med[m]]
        row.append(f"{max(mib):.1f}" if mib else "–")
        for v in (med[m].get(n, {}) for m in tiers):
            eff = f"{v['eff_gb_s']:.2f}" if "eff_gb_s" in v else "–"
            row.append(f"{eff} ({v['io_gb_s']:.2f})" if "io_gb_s" in v else eff)
        lines.append("| " + " | ".join(row) + " |")
    be = [f"{m} {verdict(v)}" for m, v in bev.items()]
    return "\n".join(lines) + ("\n\nFaster than recompute: " + "; ".join(be) + "." if be else "")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, by_len in doc["medians"].items():
        xs = sorted(by_len)
        ax.plot(xs, [by_len[n]["wall_ms"] for n in xs], marker="o", label=mode)
    ax.set(xscale="log", yscale="log", xlabel="shared prefix (tokens)", ylabel="TTFT (ms)")
    ax.set_title(f"TTFT by KV source ({doc['config']['dtype']}, median of {doc['config']['runs']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--lengths", default="64,256,1024,2048,4000", help="prefix lengths (tokens)")
    p.add_argument("--runs", type=int, default=3, help="timed requests per mode and length (3)")
    p.add_argument("--dtype", default="bfloat16", help="model and KV dtype (bfloat16)")
    p.add_argument("--modes", default=",".join(MODES), help="comma list (default all)")
    p.add_argument("--wait-idle", type=float, default=30.0, help="s to wait for an idle machine")
    p.add_argument("--retries", type=int, default=2, help="repeats of a busy request (2)")
    p.add_argument("--quick", action="store_true", help="lengths 64,512,2000, 1 run, no idle wait")
    p.add_argument("--tag", default="", help="suffix of the result files (keeps other runs)")
    p.add_argument("--write-readme", action="store_true", help="then re-render the docs' tables")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.runs, args.wait_idle = "64,512,2000", 1, 0.0
    args.lengths = sorted({int(x) for x in re.split(r"[,\s]+", args.lengths.strip()) if x})
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown modes {bad}; valid: {', '.join(MODES)}")
    date = dt.date.today().isoformat()
    stem = f"offload-{date}{'-quick' if args.quick else ''}{'-' + args.tag if args.tag else ''}"
    b, t0 = Bench(args), time.perf_counter()
    run_all(b, modes)
    med = summarize(b.samples)
    config = {k: getattr(args, k) for k in ("lengths", "runs", "dtype", "wait_idle", "retries")}
    machine = {**machine_info(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    config.update(modes=modes, suffix_tokens=SUFFIX_LEN, max_tokens=1)
    doc: dict[str, Any] = dict(benchmark="offload", date=date, file=f"{stem}.json")
    doc.update(machine=machine, config=config, medians=med, break_even=break_even(med))
    doc.update(samples=b.samples, discarded=b.discarded, elapsed_s=time.perf_counter() - t0)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    write_json(doc, RESULTS_DIR / f"{stem}.json")
    plot(doc, RESULTS_DIR / f"{stem}.png")
    table = markdown(doc)
    print(f"\nTTFT ms, median of {args.runs} (speedup vs recompute); {GBS}; {DISK}\n")
    print(table, flush=True)
    log(f"wrote {RESULTS_DIR / stem}.json and .png")
    if args.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
