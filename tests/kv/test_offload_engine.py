"""Offload tiers on the real default model (fp32): loading a prefix from host, disk or
Redis must give exactly the greedy tokens of a plain run, under a device pool so small
that cached blocks are evicted and reloaded; plus warm restart of a server, two engine
processes sharing one Redis, and every fault injected into a running engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.server_util import ServerProcess

from kvstack import LLM, SamplingParams
from kvstack.kv.hashing import hash_blocks, root_hash
from kvstack.kv.tiers.disk import DiskTier
from kvstack.testing.redis_server import LocalRedis

SYSTEM = (
    "You are the help desk of a mountain railway. Trains leave the valley station every "
    "thirty minutes from seven in the morning; the last train down leaves the summit at "
    "six in the evening. Dogs travel free, bicycles need a ticket, and the summit "
    "restaurant closes one hour before the last train. Answer briefly and exactly."
)
QUESTIONS = [
    "When does the first train leave?",
    "Can I take my bicycle up the mountain?",
    "Until when is the summit restaurant open?",
    "Do dogs need a ticket?",
]
SP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NUM_BLOCKS = 24  # 384 slots: two requests at a time, and the cache evicts constantly


def notes(i: int) -> str:
    """A distinct passage per question, so the prompts only share the system prompt."""
    return " ".join(
        f"Log {i}.{j}: car {3 * i + j} ran {12 + i * j} trips at {7 + j}:{10 * i + 5:02d}."
        for j in range(10)
    )


def prompts(llm: LLM) -> list[list[int]]:
    out = []
    for i, q in enumerate(QUESTIONS):
        ids = llm.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{notes(i)}\n{q}"},
            ],
            tokenize=True,
        )
        assert isinstance(ids, list)
        out.append(ids)
    return out


def tokens(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=ps, sampling_params=SP, check_integrity=True)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM("default", dtype="float32", prefix_cache="none", num_blocks=200)
    ps = prompts(llm)
    return ps, tokens(llm, ps)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def offload_llm(spec: str, **kw: Any) -> LLM:
    return LLM("default", dtype="float32", num_blocks=NUM_BLOCKS, kv_offload=spec, **kw)


def flush(llm: LLM) -> None:
    assert llm.engine.connector is not None
    assert llm.engine.connector.offload.flush(30)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_same_greedy_tokens_through_each_tier_under_eviction(
    tier: str,
    reference: tuple[list[list[int]], list[list[int]]],
    redis_server: LocalRedis,
    tmp_path: Path,
) -> None:
    ps, ref = reference
    spec = {
        "host": "host:64MiB",
        "disk": f"disk:{tmp_path}:64MiB",
        "redis": f"{redis_server.url}?ttl=600",
    }[tier]
    llm = offload_llm(spec, prefix_cache="radix" if tier == "host" else "hash")
    assert tokens(llm, ps) == ref  # wave 1 computes and writes through
    flush(llm)
    again = llm.generate(prompt_token_ids=ps, sampling_params=SP, check_integrity=True)
    assert [o.outputs[0].token_ids for o in again] == ref  # wave 2 reloads evicted blocks
    stats = llm.get_stats()
    st = stats.offload[tier]
    assert stats.num_evicted_blocks > 0, "the device pool was meant to evict"
    assert st.hits > 0 and st.stores > 0 and st.errors == 0 and st.corrupt == 0
    loaded = sum(o.cached_tokens_by_tier[tier] for o in again if o.cached_tokens_by_tier)
    assert llm.engine.connector is not None
    used = llm.engine.connector.num_loaded_blocks
    assert 0 < loaded <= used * 16 <= st.hits * 16
    for o in again:
        split = o.cached_tokens_by_tier
        assert split is not None and sum(split.values()) == o.num_cached_tokens
    eng = llm.engine
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks
    llm.shutdown()


def test_prompt_logprobs_requests_never_load(tmp_path: Path) -> None:
    llm = offload_llm(f"disk:{tmp_path}:64MiB")
    ps = prompts(llm)[:1]
    llm.generate(prompt_token_ids=ps, sampling_params=SP)
    flush(llm)
    llm.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate(prompt_token_ids=ps, sampling_params=sp, check_integrity=True)[0]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs is not None
    assert llm.get_stats().offload["disk"].hits == 0
    llm.shutdown()


def test_corrupt_file_is_recomputed_from_that_block_on(
    reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    ps, ref = reference
    llm = offload_llm(f"disk:{tmp_path}:64MiB")
    assert tokens(llm, ps[:1]) == ref[:1]
    flush(llm)
    llm.reset_prefix_cache()
    root = root_hash(llm.engine.model_config.name)
    hashes = hash_blocks(ps[0], 16, root)
    assert llm.engine.connector is not None
    disk = llm.engine.connector.offload.tiers[0]
    assert isinstance(disk, DiskTier)
    path = disk._path(hashes[2])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    out = llm.generate(prompt_token_ids=ps[:1], sampling_params=SP, check_integrity=True)[0]
    assert out.outputs[0].token_ids == ref[0]
    assert out.cached_tokens_by_tier == {"device": 0, "disk": 2 * 16}
    assert disk.stats.corrupt == 1
    flush(llm)  # the recomputed block was written through again, soundly this time
    assert disk.lookup_load(hashes[2:3]) != [] and disk.stats.corrupt == 1
    llm.shutdown()


@pytest.mark.slow
def test_tiny_disk_budget_evicts_files_and_stays_correct(
    reference: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    ps, ref = reference
    llm = offload_llm(f"disk:{tmp_path}:3MiB")  # four fp32 blocks (720 KiB each)
    assert tokens(llm, ps) == ref
    flush(llm)
    assert tokens(llm, ps) == ref
    st = llm.get_stats().offload["disk"]
    assert st.evictions > 0 and st.used_bytes <= 3 * 2**20
    assert len(list(tmp_path.rglob("*.kvb"))) == st.num_blocks <= 4
    llm.engine.check_integrity()
    llm.shutdown()


@pytest.mark.slow
def test_redis_killed_mid_run_then_restarted(
    reference: tuple[list[list[int]], list[list[int]]],
) -> None:
    ps, ref = reference
    with LocalRedis() as server:
        llm = offload_llm(f"{server.url}?timeout=0.2&backoff=0.5")
        assert tokens(llm, ps[:2]) == ref[:2]
        flush(llm)
        server.kill()
        llm.reset_prefix_cache()
        assert tokens(llm, ps) == ref  # served by recomputing
        st = llm.get_stats().offload["redis"]
        assert st.errors >= 1 and st.hits == 0
        server.start()  # back, and empty
        time.sleep(0.6)
        stores = st.stores
        llm.reset_prefix_cache()
        assert tokens(llm, ps) == ref
        flush(llm)
        assert llm.get_stats().offload["redis"].stores > stores
        llm.engine.check_integrity()
        llm.shutdown()


@pytest.mark.slow
def test_two_engine_processes_share_one_redis(
    reference: tuple[list[list[int]], list[list[int]]], redis_server: LocalRedis
) -> None:
    ps, ref = reference
    url = f"{redis_server.url}/3"  # a database of its own: the other tests cannot pre-warm it
    script = (
        "import json, sys\n"
        "from kvstack import LLM, SamplingParams\n"
        f"llm = LLM('default', dtype='float32', kv_offload={url!r})\n"
        "sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)\n"
        "out = llm.generate(prompt_token_ids=[json.loads(sys.argv[1])], sampling_params=sp)\n"
        "llm.shutdown()\n"
        "print(json.dumps([out[0].outputs[0].token_ids, out[0].cached_tokens_by_tier]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(ps[0])],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    first_tokens, first_split = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first_tokens == ref[0] and first_split["redis"] == 0
    llm = LLM("default", dtype="float32", kv_offload=url)  # the second replica
    out = llm.generate(prompt_token_ids=ps[:1], sampling_params=SP, check_integrity=True)[0]
    assert out.outputs[0].token_ids == ref[0]
    assert out.cached_tokens_by_tier is not None
    assert out.cached_tokens_by_tier["redis"] == (len(ps[0]) - 1) // 16 * 16
    llm.shutdown()


def _chat(url: str, content: str) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": "kv",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": content},
            ],
            "max_tokens": 8,
            "temperature": 0,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.loads(r.read()))


@pytest.mark.slow
def test_server_warm_restart_finds_its_prefixes_on_disk(tmp_path: Path) -> None:
    args = [
        "--served-model-name",
        "kv",
        "--dtype",
        "float32",
        "--kv-offload",
        f"disk:{tmp_path / 'kv'}:256MiB",
    ]
    with ServerProcess(args, tmp_path / "first.log") as srv:
        first = _chat(srv.url, QUESTIONS[0])
        assert first["usage"]["kvstack_cached_tokens"]["disk"] == 0
        assert srv.stop() == 0  # SIGTERM: graceful, queued stores are written
    assert list((tmp_path / "kv").rglob("*.kvb"))
    with ServerProcess(args, tmp_path / "second.log") as srv:
        second = _chat(srv.url, QUESTIONS[0])
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    usage = second["usage"]
    assert usage["kvstack_cached_tokens"]["disk"] > 0
    assert usage["kvstack_cached_tokens"]["disk"] == usage["prompt_tokens_details"]["cached_tokens"]
    hits = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvstack:offload_hits_total{") and 'tier="disk"' in line
    ]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) > 0
    assert "kvstack:offload_load_latency_seconds_count{model_name=" in metrics


@pytest.mark.parametrize(
    ("cmd", "spec", "message"),
    [
        ("generate", "disk:/tmp/x", "expected disk:PATH:SIZE"),
        ("serve", "host:1GiB,host:2GiB", "host is given twice"),
        ("serve", "redis://127.0.0.1:6379?ttl=soon", "ttl must be a number"),
    ],
)
@pytest.mark.slow
def test_bad_kv_offload_spec_is_one_line_and_nonzero_exit(
    cmd: str, spec: str, message: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstack.cli", cmd, "--kv-offload", spec]
        + (["hello"] if cmd == "generate" else []),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
