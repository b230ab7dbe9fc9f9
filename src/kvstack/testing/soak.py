"""A bounded soak of a real ``kvstack serve`` on loopback under attack (the fault suite).

``run_soak(SoakConfig)`` starts the processes (the server under test with ``--request-log
/dev/full``, a disk and a Redis tier and an API key; optionally a second server and a
``kvstack router`` over both), then runs two phases of fixed length:

1. **baseline**: only the well-behaved clients (short completions one after another);
2. **attack**: the same clients, with every attacker of ``soak_attacks.py`` at once
   (streams dropped mid-way, slow readers, slowloris, partial and oversize bodies,
   malformed / NaN / fan-out bodies, a 2 MB ``/tokenize``, bursts past ``--max-waiting``)
   and a timeline of faults: disk tier files corrupted every 2 s and the tier made
   unwritable, Redis killed and restarted, the router's second backend killed mid-stream.

Afterwards it waits for the server to go idle and reports: outcomes by kind and status,
p50 / p99 latency of the well-behaved clients in each phase, ``/health`` answers and the
slowest one, RSS growth, KV usage when idle, ``kvstack:internal_errors_total``, and the
server's own ``check_integrity()`` at exit (``serve.check_kv_at_exit``: the blocks still
held by requests, 0 unless KV leaked). Bounded: every phase and every wait has a limit.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvstack.testing import soak_attacks as atk
from kvstack.testing.redis_server import LocalRedis

API_KEY = "soak-key"


@dataclass(frozen=True)
class SoakConfig:
    model: str
    workdir: Path
    baseline_s: float = 20.0
    attack_s: float = 45.0  # per round
    attack_rounds: int = 2  # RSS after each: growth that continues is a leak, not warm-up
    good_clients: int = 4
    streams: int = 64
    slow_readers: int = 2
    slowloris: int = 16
    max_waiting: int = 32
    burst_every_s: float = 10.0
    redis: bool = True
    router: bool = True
    seed: int = 0
    server_args: tuple[str, ...] = ()
    startup_timeout_s: float = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """One ``python -m kvstack.cli ...`` child on a free port, logging to a file."""

    name: str
    args: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> Proc:
        cmd = [sys.executable, "-m", "kvstack.cli", *self.args, "--port", str(self.port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"{self.name} did not become healthy:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q) - 1]


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus family's samples in ``text`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Chaos:
    """The fault timeline of the attack phase (see the module docstring)."""

    def __init__(self, cfg: SoakConfig, disk: Path, redis: LocalRedis | None,
                 victim: Proc | None) -> None:  # fmt: skip
        self.cfg, self.disk, self.redis, self.victim = cfg, disk, redis, victim
        self.events: list[str] = []
        self.corrupted = 0

    def _corrupt_one(self, rng: random.Random) -> None:
        files = [p for p in self.disk.rglob("*.kvb") if p.is_file()]
        if not files:
            return
        f = rng.choice(files)
        try:
            data = bytearray(f.read_bytes())
            if len(data) > 64:
                data[len(data) // 2] ^= 0xFF
                f.write_bytes(bytes(data))
                self.corrupted += 1
        except OSError:
            return

    def _set_writable(self, writable: bool) -> None:
        mode = 0o700 if writable else 0o500
        for d in [p for p in self.disk.rglob("*") if p.is_dir()] + [self.disk]:
            os.chmod(d, mode)

    async def run(self, start: float, rng: random.Random) -> None:
        a = self.cfg.attack_s
        timeline: list[tuple[float, str]] = [
            (0.4 * a, "disk read-only"),
            (0.9 * a, "disk writable"),
        ]
        if self.redis is not None:
            timeline += [(0.3 * a, "redis killed"), (0.6 * a, "redis restarted")]
        if self.victim is not None:
            timeline.append((0.5 * a, "backend killed"))
        timeline.sort()
        next_corrupt = 0.0
        while time.monotonic() - start < a:
            now = time.monotonic() - start
            while timeline and timeline[0][0] <= now:
                _, what = timeline.pop(0)
                await asyncio.to_thread(self._apply, what)
                self.events.append(f"{now:.1f}s {what}")
            if now >= next_corrupt:
                self._corrupt_one(rng)
                next_corrupt = now + 2.0
            await asyncio.sleep(0.1)
        for _, what in timeline:  # a short run: still undo what must be undone
            if what in ("disk writable", "redis restarted"):
                await asyncio.to_thread(self._apply, what)

    def _apply(self, what: str) -> None:
        if what == "disk read-only":
            self._set_writable(False)
        elif what == "disk writable":
            self._set_writable(True)
        elif what == "redis killed" and self.redis is not None:
            self.redis.kill()
        elif what == "redis restarted" and self.redis is not None:
            self.redis.start()
        elif what == "backend killed" and self.victim is not None:
            self.victim.stop(signal.SIGKILL)


async def _phase(
    cfg: SoakConfig, target: atk.Target, seconds: float, attack: bool,
    chaos: Chaos | None, router: atk.Target | None,
) -> tuple[atk.Tally, float]:  # fmt: skip
    tally, worst = atk.Tally(), [0.0]
    rng = random.Random(cfg.seed + (1 if attack else 0))
    start = time.monotonic()
    deadline = start + seconds
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s:
        tasks = [atk.well_behaved(s, target, deadline, tally) for _ in range(cfg.good_clients)]
        tasks.append(atk.health_probe(s, target, deadline, tally, worst))
        if attack:
            tasks += [atk.disconnecting_streams(s, target, deadline, tally,
                                                random.Random(rng.random()))
                      for _ in range(cfg.streams)]  # fmt: skip
            tasks += [atk.slow_reader(s, target, deadline, tally) for _ in range(cfg.slow_readers)]
            tasks += [atk.slowloris(target, deadline, tally) for _ in range(cfg.slowloris)]
            tasks.append(atk.raw_abuse(target, deadline, tally, random.Random(rng.random())))
            tasks.append(atk.bad_bodies(s, target, deadline, tally, random.Random(rng.random())))
            tasks.append(atk.burst(s, target, deadline, tally, 3 * cfg.max_waiting,
                                   cfg.burst_every_s))  # fmt: skip
            if router is not None:
                tasks += [atk.disconnecting_streams(s, router, deadline, tally,
                                                    random.Random(rng.random()), "router-stream")
                          for _ in range(4)]  # fmt: skip
            if chaos is not None:
                tasks.append(chaos.run(start, random.Random(rng.random())))
        await asyncio.wait_for(asyncio.gather(*tasks), seconds + 150)
    return tally, worst[0]


def _server_args(cfg: SoakConfig, disk: Path, redis: LocalRedis | None) -> list[str]:
    tiers = f"disk:{disk}:64MiB" + (f",{redis.url}?timeout=0.1&backoff=1" if redis else "")
    return ["serve", "--model", cfg.model, "--api-key", API_KEY, "--max-waiting",
            str(cfg.max_waiting), "--request-log", "/dev/full", "--kv-offload", tiers,
            "--header-timeout", "2", "--body-timeout", "5", "--request-timeout", "120",
            *cfg.server_args]  # fmt: skip


def _idle(target: atk.Target, timeout_s: float) -> dict[str, Any]:
    """The server's /load once it has no running or waiting request (or at the timeout)."""
    import json

    deadline = time.monotonic() + timeout_s
    req = urllib.request.Request(target.url + "/load", headers=target.headers())
    load: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(req, timeout=10) as r:
            load = json.loads(r.read())
        if load["num_requests_running"] == 0 and load["num_requests_waiting"] == 0:
            break
        time.sleep(0.5)
    return load


def run_soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak; the report (see the module docstring). Stops every process it started."""
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    disk = cfg.workdir / "disk-tier"
    redis = LocalRedis().start() if cfg.redis else None
    server = Proc("server", _server_args(cfg, disk, redis), cfg.workdir / "server.log")
    other: Proc | None = None
    router: Proc | None = None
    t0 = time.monotonic()
    try:
        server.start(cfg.startup_timeout_s)
        if cfg.router:
            other = Proc("backend-b", ["serve", "--model", cfg.model, *cfg.server_args],
                         cfg.workdir / "backend-b.log").start(cfg.startup_timeout_s)  # fmt: skip
            router = Proc("router", ["router", "--backend", server.url, "--backend", other.url,
                                     "--policy", "round_robin", "--health-interval", "0.5",
                                     "--api-key", API_KEY], cfg.workdir / "router.log")  # fmt: skip
            router.start(cfg.startup_timeout_s)
        target = atk.Target(server.url, API_KEY)
        via_router = atk.Target(router.url, API_KEY) if router is not None else None
        base, base_worst = asyncio.run(_phase(cfg, target, cfg.baseline_s, False, None, None))
        rss = [server.rss_mb()]
        attack, attack_worst, events, corrupted = atk.Tally(), 0.0, [], 0
        load: dict[str, Any] = {}
        for _ in range(cfg.attack_rounds):
            chaos = Chaos(cfg, disk, redis, other)
            got, worst = asyncio.run(_phase(cfg, target, cfg.attack_s, True, chaos, via_router))
            attack.merge(got)
            attack_worst = max(attack_worst, worst)
            events.append(" / ".join(chaos.events))
            corrupted += chaos.corrupted
            load = _idle(target, 90.0)
            rss.append(server.rss_mb())
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        alive = server.proc is not None and server.proc.poll() is None
        code = server.stop()
        log = server.tail()
    finally:
        for p in (router, other, server):
            if p is not None:
                p.stop(signal.SIGKILL, 10)
        if redis is not None:
            redis.kill()
        if disk.exists():
            for d in [p for p in disk.rglob("*") if p.is_dir()] + [disk]:
                os.chmod(d, 0o700)
    exit_line = re.search(r"KV at exit: integrity (\w+), (\d+) of (\d+) blocks held", log)
    health: list[Counter[str]] = [t.counts.get("health", Counter()) for t in (base, attack)]
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "duration_s": round(time.monotonic() - t0, 1),
        "engine_alive_throughout": alive and all(set(h) == {"200"} for h in health),
        "health": {
            "probes": sum(sum(h.values()) for h in health),
            "slowest_s": round(max(base_worst, attack_worst), 3),
        },
        "good_p50_s": _by_phase(base, attack, 50),
        "good_p99_s": _by_phase(base, attack, 99),
        "outcomes": {"baseline": base.as_dict(), "attack": attack.as_dict()},
        "chaos": [*events, f"{corrupted} disk-tier files corrupted"],
        "rss_mb": {
            "after_baseline": round(rss[0], 1),
            "after_each_attack_round": [round(x, 1) for x in rss[1:]],
            "growth_total": round(rss[-1] - rss[0], 1),
            "growth_last_round": round(rss[-1] - rss[-2], 1) if len(rss) > 2 else None,
        },
        "idle_load": load,
        "kv_usage_idle": metric(metrics, "kvstack:kv_cache_usage_perc"),
        "internal_errors": metric(metrics, "kvstack:internal_errors_total"),
        "offload_errors": metric(metrics, "kvstack:offload_errors_total"),
        "offload_corrupt_blocks": metric(metrics, "kvstack:offload_corrupt_blocks_total"),
        "exit_code": code,
        "kv_integrity_at_exit": exit_line.group(1) if exit_line else None,
        "kv_blocks_leaked": int(exit_line.group(2)) if exit_line else None,
        "kv_blocks_total": int(exit_line.group(3)) if exit_line else None,
    }


def _by_phase(base: atk.Tally, attack: atk.Tally, q: float) -> dict[str, float | None]:
    return {"baseline": percentile(base.latencies, q), "attack": percentile(attack.latencies, q)}
