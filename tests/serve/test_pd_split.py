"""Prefill/decode split: `kvstack serve --role prefill|decode` sharing one Redis KV tier,
sequenced by `kvstack router`. A prefill replica computes the prompt and answers only
when its blocks are in Redis; the decode replica then loads them instead of recomputing,
and its output is the same as a plain server's. If the hand-off fails, decode recomputes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstack.testing.redis_server import LocalRedis
from server_util import ServerProcess, free_port

PROMPT = (
    "The museum opens at nine and closes at six. Tickets cost twelve euros, students pay "
    "half, and children under twelve enter for free. Guided tours start every hour from "
    "the main hall and last about forty minutes. The cafe on the second floor serves "
    "soup, sandwiches and cakes until half past five. Question: when does the last tour "
    "start, and can a student with a child get in for less than ten euros? Answer:"
)
COMMON = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def redis() -> Iterator[LocalRedis]:
    with LocalRedis() as r:
        yield r


@pytest.fixture(scope="module")
def replicas(
    redis: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    d = tmp_path_factory.mktemp("pd")
    tier = ["--kv-offload", redis.url]
    with (
        ServerProcess(["--role", "prefill", *tier, *COMMON], d / "prefill.log") as p,
        ServerProcess(["--role", "decode", *tier, *COMMON], d / "decode.log") as dec,
        ServerProcess(COMMON, d / "plain.log") as plain,
    ):
        yield {"prefill": p, "decode": dec, "plain": plain}


def complete(url: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_roles_need_a_shared_tier(tmp_path: Path) -> None:
    from kvstack.cli import main

    assert main(["serve", "--role", "prefill", "--port", str(free_port())]) == 2


@pytest.mark.slow
def test_prefill_then_decode_loads_the_prompt_from_redis(
    replicas: dict[str, ServerProcess],
) -> None:
    assert httpx.get(replicas["prefill"].url + "/load").json()["role"] == "prefill"
    pre = complete(replicas["prefill"].url)
    assert pre["usage"]["completion_tokens"] == 1  # the prefill role answers one token
    out = complete(replicas["decode"].url)
    n_prompt = out["usage"]["prompt_tokens"]
    by_tier = out["usage"]["kvstack_cached_tokens"]
    assert by_tier["redis"] == (n_prompt - 1) // 16 * 16  # every full block but the last token's
    assert out["choices"][0]["text"] == complete(replicas["plain"].url)["choices"][0]["text"]


@pytest.mark.slow
def test_router_sequences_prefill_and_decode(
    replicas: dict[str, ServerProcess], tmp_path: Path
) -> None:
    """`kvstack router` sees the roles in /load: prefill first, then the decode replica,
    whose answer the client gets (a new prompt, so the hit can only come from Redis)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvstack.cli", "router", "--port", str(port)]
    cmd += ["--backend", replicas["prefill"].url, "--backend", replicas["decode"].url]
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()
            time.sleep(0.3)
        prompt = PROMPT.replace("nine", "ten").replace("six", "seven")
        out = complete(url, prompt=prompt, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == 16  # the decode replica's answer
        assert out["usage"]["kvstack_cached_tokens"]["redis"] > 0
        want = complete(replicas["plain"].url, prompt=prompt, ignore_eos=True)
        assert out["choices"][0]["text"] == want["choices"][0]["text"]
        state = httpx.get(url + "/router/state", timeout=10).json()
        assert state, state
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.mark.slow
def test_decode_recomputes_when_the_hand_off_is_lost(
    replicas: dict[str, ServerProcess], redis: LocalRedis
) -> None:
    """Redis killed between prefill and decode: the decode replica recomputes the prompt
    (its tier lookup fails fast) and still answers the same text."""
    prompt = PROMPT.replace("twelve euros", "fifteen euros")
    complete(replicas["prefill"].url, prompt=prompt)
    redis.kill()
    try:
        out = complete(replicas["decode"].url, prompt=prompt)
        assert out["usage"]["kvstack_cached_tokens"]["redis"] == 0
        want = complete(replicas["plain"].url, prompt=prompt)
        assert out["choices"][0]["text"] == want["choices"][0]["text"]
    finally:
        redis.restart()
