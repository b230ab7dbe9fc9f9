"""The clients of the soak (``soak.py``): well-behaved ones and attackers.

Each coroutine loops until ``deadline`` (``time.monotonic()``) and records every outcome in
a ``Tally`` under its kind: an HTTP status (``"200"``, ``"429"``...) or what happened
instead (``"disconnected"`` by us on purpose, ``"closed"`` by the server, an exception
name). Nothing here asserts: the soak reports, ``tests/test_faults.py`` checks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

GOOD_PROMPT = "Write one sentence about the sea and the sky."
TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Tally:
    """Outcomes by kind; latencies of the well-behaved clients' completed requests."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    def add(self, kind: str, outcome: int | str) -> None:
        self.counts.setdefault(kind, Counter())[str(outcome)] += 1

    def merge(self, other: Tally) -> None:
        for kind, c in other.counts.items():
            self.counts.setdefault(kind, Counter()).update(c)
        self.latencies += other.latencies

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(sorted(c.items())) for k, c in sorted(self.counts.items())}


@dataclass(frozen=True)
class Target:
    url: str  # http://127.0.0.1:PORT
    api_key: str | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def good_body(max_tokens: int = 16) -> dict[str, Any]:
    return {"prompt": GOOD_PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip


async def well_behaved(
    s: aiohttp.ClientSession, t: Target, deadline: float, tally: Tally, kind: str = "good"
) -> None:
    """Short completions one after another, as a polite client sends them: a 429 is
    retried after its ``Retry-After`` (at most 1 s here), and a request's latency runs
    from its first attempt to its answer."""
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        try:
            async with s.post(t.url + "/v1/completions", json=good_body(), headers=t.headers(),
                              timeout=TIMEOUT) as r:  # fmt: skip
                await r.read()
                tally.add(kind, r.status)
                if r.status == 429:
                    await asyncio.sleep(min(1.0, float(r.headers.get("Retry-After", "1"))))
                    continue
                if r.status == 200:
                    tally.latencies.append(time.monotonic() - t0)
        except (aiohttp.ClientError, TimeoutError) as e:
            tally.add(kind, type(e).__name__)
        await asyncio.sleep(0.05)
        t0 = time.monotonic()


async def disconnecting_streams(
    s: aiohttp.ClientSession, t: Target, deadline: float, tally: Tally, rng: random.Random,
    kind: str = "stream",
) -> None:  # fmt: skip
    """Streams of random size, n and logprobs; about half are dropped mid-way."""
    while time.monotonic() < deadline:
        body = {
            "prompt": f"Story number {rng.randint(0, 10**6)}:", "stream": True,
            "max_tokens": rng.randint(4, 48), "n": rng.choice([1, 1, 2, 4]),
            "logprobs": rng.choice([None, 2]), "ignore_eos": True,
        }  # fmt: skip
        stop_after = rng.choice([0, 1, 3, None, None])
        try:
            async with s.post(t.url + "/v1/completions", json=body, headers=t.headers(),
                              timeout=TIMEOUT) as r:  # fmt: skip
                if r.status != 200:
                    await r.read()
                    tally.add(kind, r.status)
                    await asyncio.sleep(0.05)  # rejected (429): straight back, nearly
                    continue
                chunks = 0
                while chunk := await r.content.readany():
                    chunks += 1
                    if b'"error"' in chunk:
                        tally.add(kind, "error-event")
                    if stop_after is not None and chunks > stop_after:
                        r.close()  # the connection goes away mid-response
                        tally.add(kind, "disconnected")
                        break
                else:
                    tally.add(kind, r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            tally.add(kind, type(e).__name__)


async def slow_reader(s: aiohttp.ClientSession, t: Target, deadline: float, tally: Tally) -> None:
    """n=16 with logprobs, read one chunk a second (the output queue must not grow)."""
    while time.monotonic() < deadline:
        body = {"prompt": "Slowly:", "stream": True, "max_tokens": 48, "n": 16, "logprobs": 5,
                "ignore_eos": True}  # fmt: skip
        try:
            async with s.post(t.url + "/v1/completions", json=body, headers=t.headers(),
                              timeout=TIMEOUT) as r:  # fmt: skip
                while await r.content.readany():
                    await asyncio.sleep(1.0)
                tally.add("slow-reader", r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            tally.add("slow-reader", type(e).__name__)


async def _raw(t: Target, data: bytes, trickle: bytes = b"", every_s: float = 0.5,
               deadline: float = 0.0) -> str:  # fmt: skip
    """Send ``data``, then ``trickle`` one byte per ``every_s`` until ``deadline``; the
    answer's status, or "closed" if the server closed without one, "held" if it never did."""
    reader, writer = await asyncio.open_connection(*t.host_port)
    try:
        writer.write(data)
        await writer.drain()
        for b in trickle:
            if time.monotonic() >= deadline:
                return "held"
            writer.write(bytes([b]))
            await writer.drain()
            try:
                got = await asyncio.wait_for(reader.read(64), every_s)
            except TimeoutError:
                continue
            return _status(got) if got else "closed"
        try:
            got = await asyncio.wait_for(reader.read(4096), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            return "held"
        return _status(got) if got else "closed"
    except (ConnectionError, OSError):
        return "closed"
    finally:
        writer.close()


def _status(head: bytes) -> str:
    parts = head.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 and parts[1].isdigit() else "garbage"


SLOWLORIS_HOLD_S = 15.0  # a connection the server holds this long is reported "held"


async def slowloris(t: Target, deadline: float, tally: Tally) -> None:
    """Headers one byte every half second, never finished: each connection trickles until
    the server closes it or ``SLOWLORIS_HOLD_S`` passes (past the phase's end if need be)."""
    while time.monotonic() < deadline:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\n"
        until = time.monotonic() + SLOWLORIS_HOLD_S
        tally.add("slowloris", await _raw(t, head, b"X-Slow: " + b"a" * 400, 0.5, until))


async def raw_abuse(t: Target, deadline: float, tally: Tally, rng: random.Random) -> None:
    """A partial body (Content-Length 100, 10 sent) and a declared 9 MiB body."""
    auth = f"Authorization: Bearer {t.api_key}\r\n".encode() if t.api_key else b""
    partial = rng.random() < 0.5
    while time.monotonic() < deadline:
        partial = not partial  # alternate: a partial body waits out --body-timeout
        if partial:
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: "
                    b"application/json\r\nContent-Length: 100\r\nConnection: close\r\n" + auth
                    + b"\r\n{\"prompt\":")  # fmt: skip
            tally.add("partial-body", await _raw(t, head, deadline=time.monotonic() + 30))
        else:
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Length: 9437184\r\n"
                    b"Connection: close\r\n" + auth + b"\r\n")  # fmt: skip
            tally.add("oversize", await _raw(t, head, deadline=time.monotonic() + 30))
        await asyncio.sleep(0.2)


BAD_BODIES: list[tuple[str, bytes]] = [
    ("malformed", b"{"),
    ("malformed", b"\xff\xfe\x00garbage"),
    ("malformed", b"[1, 2]"),
    ("malformed", b"[" * 100_000 + b"]" * 100_000),
    ("malformed", b'{"prompt": 5, "max_tokens": "x"}'),
    ("malformed", b'{"prompt": "hi", "logprobs": 100}'),
    ("nan", b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}'),
    ("nan", b'{"prompt": "hi", "max_tokens": 4, "repetition_penalty": Infinity}'),
    ("fan-out", json.dumps({"prompt": [[5, 6, 7]] * 32, "n": 16, "max_tokens": 1}).encode()),
]
CHAT_BAD = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       "chat_template_kwargs": {"source": "x"}}).encode()  # fmt: skip


async def bad_bodies(
    s: aiohttp.ClientSession, t: Target, deadline: float, tally: Tally, rng: random.Random
) -> None:
    """Malformed JSON, wrong types, NaN / Infinity, fan-out, a template-kwargs clash, a
    2 MB /tokenize without the key and one with it."""
    headers = {**t.headers(), "Content-Type": "application/json"}
    big = json.dumps({"prompt": "word " * 400_000}).encode()
    last_big = 0.0  # one authorized 2 MB /tokenize per 5 s: seconds of CPU each
    while time.monotonic() < deadline:
        kind, body = rng.choice(BAD_BODIES)
        path = "/v1/completions"
        roll = rng.random()
        if roll < 0.1:
            kind, body, path = "template-clash", CHAT_BAD, "/v1/chat/completions"
        elif roll < 0.15:
            kind, body, path = "tokenize-no-key", big, "/tokenize"
        elif time.monotonic() - last_big > 5.0:
            kind, body, path = "tokenize-2MB", big, "/tokenize"
            last_big = time.monotonic()
        hdrs = headers if kind != "tokenize-no-key" else {"Content-Type": "application/json"}
        try:
            async with s.post(t.url + path, data=body, headers=hdrs, timeout=TIMEOUT) as r:
                await r.read()
                tally.add(kind, r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            tally.add(kind, type(e).__name__)
        await asyncio.sleep(0.02)


async def burst(
    s: aiohttp.ClientSession, t: Target, deadline: float, tally: Tally, size: int, every_s: float
) -> None:
    """``size`` requests at once every ``every_s``: past ``--max-waiting`` they get 429.
    Each asks for 64 tokens so that the first ones admitted still hold their slots while
    the rest arrive (with 8 tokens a fast CPU served a burst as quickly as it came)."""

    async def one() -> None:
        try:
            async with s.post(t.url + "/v1/completions", json=good_body(64),
                              headers=t.headers(), timeout=TIMEOUT) as r:  # fmt: skip
                await r.read()
                tally.add("burst", r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            tally.add("burst", type(e).__name__)

    while time.monotonic() + every_s < deadline:
        await asyncio.sleep(every_s)
        await asyncio.gather(*(one() for _ in range(size)))


async def health_probe(
    s: aiohttp.ClientSession, t: Target, deadline: float, tally: Tally, worst: list[float]
) -> None:
    """GET /health every 0.25 s (as a router would); the slowest answer in ``worst``."""
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        try:
            async with s.get(t.url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
                tally.add("health", r.status)
        except (aiohttp.ClientError, TimeoutError) as e:
            tally.add("health", type(e).__name__)
        worst[0] = max(worst[0], time.monotonic() - t0)
        await asyncio.sleep(0.25)
