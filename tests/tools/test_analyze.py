"""``kvstack analyze``: replay of request logs through the engine's prefix cache, no model.

Block size 4 everywhere (``BS``); every expected number is worked out in a comment.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstack.config.engine import SchedulerConfig
from kvstack.core.errors import ConfigError
from kvstack.core.request import Request, SamplingParams
from kvstack.kv.manager import KVCacheManager
from kvstack.sched.scheduler import Scheduler
from kvstack.tools.analyze import (
    AnalyzeOptions,
    OraclePolicy,
    add_analyze_args,
    analyze,
    check_cache_regression,
    find_knee,
    json_depth,
    read_log,
    replay,
    run_analyze,
)

BS = 4


def write_log(path: Path, rows: list[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def tokens_log(
    path: Path, prompts: list[list[int]], sessions: list[str | None] | None = None
) -> Path:
    sessions = sessions or [None] * len(prompts)
    rows = [
        {"timestamp": float(i), "prompt_token_ids": p, "session_id": s}
        for i, (p, s) in enumerate(zip(prompts, sessions, strict=True))
    ]
    return write_log(path, rows)


def args_for(log: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_analyze_args(parser)
    return parser.parse_args([str(log), "--quiet", "--block-size", str(BS), *extra])


def result(report: dict[str, Any], policy: str, size: int) -> dict[str, Any]:
    (r,) = [
        r for r in report["results"] if r["policy"] == policy and r["cache_size_tokens"] == size
    ]
    return r


def test_repeated_prompt_hit_rates(tmp_path: Path) -> None:
    # A: 9 tokens = 2 full blocks + 1; a hit covers at most (9 - 1) // 4 = 2 blocks = 8 tokens.
    a = [1, 2, 3, 4, 5, 6, 7, 8, 100]
    parsed = read_log(tokens_log(tmp_path / "l.jsonl", [a, a, a]))
    report = analyze(parsed, AnalyzeOptions(block_size=BS, cache_sizes=[64]))
    for policy in ("lru", "lfu", "adaptive", "oracle"):
        r = result(report, policy, 64)
        # request 0 misses, requests 1 and 2 hit 8 tokens each: 16 / (3 * 9) = 16 / 27.
        assert r["hit_tokens"] == 16 and r["prefill_tokens_saved"] == 16
        assert r["token_hit_rate"] == pytest.approx(16 / 27, abs=1e-6)
        assert r["request_hit_rate"] == pytest.approx(2 / 3, abs=1e-6)
        assert r["num_blocks"] == 64 // BS
    assert result(report, "none", 64)["hit_tokens"] == 0
    assert report["ideal_hit_rate"] == pytest.approx(16 / 27, abs=1e-6)
    assert report["knees"]["lru"] == 64


def test_oracle_beats_lru_on_a_cycle_larger_than_the_cache(tmp_path: Path) -> None:
    # X, Y, Z: 5 tokens each (1 full block + 1 partial: 2 blocks to allocate, 1 block
    # cached after), hittable blocks (5 - 1) // 4 = 1. Pool of 3 blocks (12 tokens): after a
    # request, 2 blocks are cached and 1 is plain free, so the next miss must evict one.
    x, y, z = [1, 1, 1, 1, 9], [2, 2, 2, 2, 9], [3, 3, 3, 3, 9]
    prompts = [x, y, z] * 3
    parsed = read_log(tokens_log(tmp_path / "c.jsonl", prompts))
    report = analyze(parsed, AnalyzeOptions(block_size=BS, cache_sizes=[12]))
    # LRU always evicts the block needed next: 0 hits out of 9 * 5 = 45 tokens.
    assert result(report, "lru", 12)["hit_tokens"] == 0
    # Belady: t=2 (Z) evicts Y (next use 4) not X (3); t=3 X hits; t=4 Y evicts X (next 6)
    # not Z (5); t=5 Z hits; t=6 X evicts Z (8) not Y (7); t=7 Y hits; t=8 Z misses.
    # 3 hits x 4 tokens = 12 of 45.
    oracle = result(report, "oracle", 12)
    assert oracle["hit_tokens"] == 12
    assert oracle["token_hit_rate"] == pytest.approx(12 / 45, abs=1e-6)
    assert oracle["request_hit_rate"] == pytest.approx(3 / 9, abs=1e-6)


def test_oracle_plugs_into_the_manager() -> None:
    kv = KVCacheManager(4, BS, prefix_cache="hash", model_id="")
    oracle = OraclePolicy(4, {}, [])
    assert kv.cache is not None
    kv.cache.policy = oracle
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    assert kv.allocate_slots(r, 5, kv.get_computed_blocks(r)) is not None
    r.num_computed_tokens = 5
    kv.free(r)
    assert len(oracle) == 1  # its one full block is an eviction candidate of the oracle
    kv.check_integrity()


def test_within_vs_cross_session(tmp_path: Path) -> None:
    p = [1, 2, 3, 4, 5, 6, 7, 8]
    prompts = [
        [*p, 50, 51, 52, 53, 54],  # a: 13 tokens, full blocks P0 P1 Q2 (first stored by a)
        [*p, 60],  # b: 9 tokens, hits P0 P1 = 8 tokens stored first by a -> cross 8
        [*p, 50, 51, 52, 53, 54, 70],  # a: 14 tokens, hits (14-1)//4 = 3 blocks -> within 12
        [*p, 61],  # no session: hits P0 P1 -> cross 8 (no session is never "within")
    ]
    parsed = read_log(tokens_log(tmp_path / "s.jsonl", prompts, ["a", "b", "a", None]))
    report = analyze(parsed, AnalyzeOptions(block_size=BS, cache_sizes=[256], policies=("lru",)))
    r = result(report, "lru", 256)
    assert r["hit_tokens"] == 8 + 12 + 8
    assert r["within_session_hit_tokens"] == 12
    assert r["cross_session_hit_tokens"] == 16
    assert report["num_sessions"] == 2
    # P (8 tokens) is in all 4 requests; P+Q2 (12 tokens) in requests 0 and 2.
    top = {(d["length_tokens"], d["frequency"]) for d in report["shared_prefixes"]}
    assert top == {(8, 4), (12, 2)}


def test_session_field_and_timestamp_order(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 2.0, "prompt_token_ids": [1, 2, 3, 4, 9], "conv": "x"},
        {"timestamp": 1.0, "prompt_token_ids": [1, 2, 3, 4, 8], "conv": "y"},
    ]
    parsed = read_log(write_log(tmp_path / "t.jsonl", rows), session_field="conv")
    assert parsed.ordered_by == "timestamp"
    assert [r.session_id for r in parsed.requests] == ["y", "x"]
    assert [r.line_no for r in parsed.requests] == [2, 1]


def test_knee() -> None:
    curve = [(16, 0.1), (32, 0.5), (64, 0.69), (128, 0.7)]
    assert find_knee(curve, 0.02) == 64  # 0.69 >= 0.70 - 0.02; 0.5 is not
    assert find_knee(curve, 0.0) == 128
    assert find_knee(curve, 0.6) == 16  # 0.1 >= 0.7 - 0.6
    assert find_knee([], 0.02) is None


def test_regression_check_both_directions(tmp_path: Path) -> None:
    def rep(rate: float) -> dict[str, Any]:
        return {"results": [{"policy": "lru", "cache_size_tokens": 64, "token_hit_rate": rate}]}

    assert len(check_cache_regression(rep(0.50), rep(0.60), 0.02)) == 1  # dropped 0.10
    assert check_cache_regression(rep(0.60), rep(0.50), 0.02) == []  # improved
    assert check_cache_regression(rep(0.59), rep(0.60), 0.02) == []  # within tolerance
    other = {"results": [{"policy": "lfu", "cache_size_tokens": 64, "token_hit_rate": 0.9}]}
    assert check_cache_regression(rep(0.1), other, 0.02) == []  # nothing in common

    a = [1, 2, 3, 4, 5, 6, 7, 8, 100]
    log = tokens_log(tmp_path / "l.jsonl", [a, a, a])  # lru @ 64: 16/27 = 0.5926
    base = tmp_path / "base.json"
    base.write_text(json.dumps(rep(0.9)))
    assert run_analyze(args_for(log, "--cache-size", "64", "--baseline", str(base))) == 1
    base.write_text(json.dumps(rep(0.6)))  # 0.6 - 0.5926 = 0.0074 <= 0.02
    assert run_analyze(args_for(log, "--cache-size", "64", "--baseline", str(base))) == 0


def test_outputs_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 100]
    log = tokens_log(tmp_path / "l.jsonl", [a, [*a, 5], a])
    out, png = tmp_path / "r.json", tmp_path / "c.png"
    args = args_for(log, "--cache-size", "32,64", "--output-json", str(out), "--plot", str(png))
    assert run_analyze(args) == 0
    report = json.loads(out.read_text())
    assert report["cache_sizes"] == [32, 64] and len(report["results"]) == 5 * 2
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "token hit" in capsys.readouterr().out


def test_malformed_lines_reported_and_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    rows: list[Any] = [
        good,
        "not json",  # line 2
        "[1, 2]",  # line 3: not an object
        {"prompt_token_ids": []},  # line 4: empty
        {"prompt_token_ids": [1, "x"]},  # line 5: not token ids
        "",  # line 6: blank lines are skipped silently
        {"prompt_token_ids": [1, 2, 3, 4, 6], "timestamp": "yesterday"},  # line 7
        good,
    ]
    log = write_log(tmp_path / "m.jsonl", rows)
    parsed = read_log(log)
    assert [n for n, _ in parsed.malformed] == [2, 3, 4, 5, 7]
    assert parsed.num_malformed == 5 and len(parsed.requests) == 2
    assert parsed.ordered_by == "file order"  # no timestamps
    assert run_analyze(args_for(log, "--cache-size", "64")) == 0
    err = capsys.readouterr().err
    assert "5 malformed line(s)" in err and "line 2:" in err and "line 7:" in err
    with pytest.raises(ConfigError, match=r"m\.jsonl:2: malformed line"):
        read_log(log, strict=True)
    with pytest.raises(ConfigError, match=":2:"):
        run_analyze(args_for(log, "--strict"))


def test_many_malformed_lines_shows_first_ten(tmp_path: Path) -> None:
    log = write_log(tmp_path / "m.jsonl", ["{bad"] * 25 + [json.dumps({"prompt_token_ids": [1]})])
    parsed = read_log(log)
    assert parsed.num_malformed == 25
    assert [n for n, _ in parsed.malformed] == list(range(1, 11))


def test_symlink_and_non_regular_refused(tmp_path: Path) -> None:
    real = tokens_log(tmp_path / "real.jsonl", [[1, 2, 3]])
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="symlink"):
        read_log(link)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_log(tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_log(tmp_path / "missing.jsonl")


def test_size_limits(tmp_path: Path) -> None:
    log = tokens_log(tmp_path / "l.jsonl", [[1, 2, 3, 4, 5]] * 10)
    with pytest.raises(ConfigError, match="over the limit"):
        read_log(log, max_file_bytes=100)
    with pytest.raises(ConfigError, match="over the limit"):
        run_analyze(args_for(log, "--max-file-bytes", "100"))
    # A line longer than max_line_bytes is malformed; the lines after it still count.
    long_line = json.dumps({"prompt_token_ids": list(range(1000))})
    log2 = write_log(tmp_path / "long.jsonl", [long_line, {"prompt_token_ids": [1, 2]}])
    parsed = read_log(log2, max_line_bytes=200)
    assert parsed.malformed[0][0] == 1 and "longer than" in parsed.malformed[0][1]
    assert [r.line_no for r in parsed.requests] == [2]


def test_nesting_depth(tmp_path: Path) -> None:
    assert json_depth(b'{"a": [[1], "[[[["]}') == 3
    deep = "[" * 100_000 + "]" * 100_000  # would overflow the JSON parser's recursion
    nested = {"prompt_token_ids": [1, 2, 3]}
    for _ in range(70):
        nested = {"x": nested}
    log = write_log(tmp_path / "d.jsonl", [deep, nested, {"prompt_token_ids": [1, 2]}])
    parsed = read_log(log)
    assert [n for n, _ in parsed.malformed] == [1, 2]
    assert all("nested" in e for _, e in parsed.malformed)
    assert len(parsed.requests) == 1


def test_bad_options(tmp_path: Path) -> None:
    log = tokens_log(tmp_path / "l.jsonl", [[1, 2, 3]])
    with pytest.raises(ConfigError, match="smaller than one block"):
        run_analyze(args_for(log, "--cache-size", "2"))
    with pytest.raises(SystemExit):
        args_for(log, "--policy", "fifo")
    empty = write_log(tmp_path / "e.jsonl", ["{bad"])
    with pytest.raises(ConfigError, match="no valid requests"):
        run_analyze(args_for(empty))


def serve_one_at_a_time(prompts: list[list[int]], num_blocks: int, policy: str) -> int:
    """Prefix-hit tokens of the real scheduler serving ``prompts`` sequentially."""
    kv = KVCacheManager(num_blocks, BS, prefix_cache="hash", eviction_policy=policy)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096), kv, max_model_len=4096
    )
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", list(p), SamplingParams(temperature=0, max_tokens=1)))
        while sched.has_unfinished_requests():
            out = sched.schedule()
            sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled})
        kv.check_integrity()
    return kv.prefix_hit_tokens


@pytest.mark.parametrize("policy", ["lru", "lfu", "adaptive"])
def test_replay_matches_the_engine_scheduler(tmp_path: Path, policy: str) -> None:
    rng = random.Random(policy)
    systems = [[rng.randrange(1, 50) for _ in range(rng.choice([6, 9, 14]))] for _ in range(4)]
    prompts = [
        rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
        for _ in range(120)
    ]
    parsed = read_log(tokens_log(tmp_path / "r.jsonl", prompts))
    for num_blocks in (8, 12, 20, 64):  # every request (<= 26 + 1 tokens) fits in 8 blocks
        r = replay(parsed.requests, policy, num_blocks * BS, BS)
        assert r.hit_tokens == serve_one_at_a_time(prompts, num_blocks, policy)
        assert r.hit_tokens > 0


def test_openai_format_with_default_tokenizer(tmp_path: Path) -> None:
    from kvstack.model.loader.registry import load_tokenizer
    from kvstack.tools.workloads import make_workload, write_jsonl

    tok = load_tokenizer("default")
    reqs = make_workload("multi-turn", tok, 10, num_turns=2)
    log = tmp_path / "w.jsonl"
    write_jsonl(reqs, log)
    with open(log, "a", encoding="utf-8") as f:
        f.write(json.dumps({"session_id": "p", "body": {"prompt": "Hello there"}}) + "\n")
        f.write(json.dumps({"prompt": [1, 2, 3, 4, 5]}) + "\n")
    parsed = read_log(log, "openai", tokenizer="default")
    assert parsed.num_malformed == 0
    ids = [r.token_ids.tolist() for r in parsed.requests]
    assert ids[:10] == [r.prompt_token_ids for r in reqs]  # chat template applied exactly
    assert ids[10] == tok.encode("Hello there") and ids[11] == [1, 2, 3, 4, 5]
    assert parsed.requests[10].session_id == "p"
    report = analyze(parsed, AnalyzeOptions(block_size=16, policies=("lru", "oracle")))
    assert report["ideal_hit_rate"] > 0.3  # every conversation shares the system prompt


def test_kvstack_server_log_format(tmp_path: Path) -> None:
    # Rows shaped like AsyncEngine._finish's request log; observed = 8 / (9 + 9) cached.
    row = {"request_id": "x", "session_id": "s", "num_output_tokens": 3}
    a = [1, 2, 3, 4, 5, 6, 7, 8, 100]
    rows = [
        {**row, "timestamp": 10.0, "prompt_token_ids": a, "num_cached_tokens": 0},
        {**row, "timestamp": 11.0, "prompt_token_ids": a, "num_cached_tokens": 8},
    ]
    parsed = read_log(write_log(tmp_path / "k.jsonl", rows), "kvstack")
    report = analyze(parsed, AnalyzeOptions(block_size=BS, cache_sizes=[64], policies=("lru",)))
    assert report["observed_hit_rate"] == pytest.approx(8 / 18, abs=1e-6)
    r = result(report, "lru", 64)
    assert r["hit_tokens"] == 8 and r["within_session_hit_tokens"] == 8


def test_python_m_help() -> None:
    """``python -m kvstack.tools.analyze --help``: the package's ``__main__`` runs."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstack.tools.analyze", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m kvstack.tools.analyze")
    assert "--cache-size" in out


def test_segment_hit_rate_beside_the_prefix_one(tmp_path: Path) -> None:
    """kvstack logs carry each request's segments (segment reuse): two documents sent in both
    orders are reused only by segments, and the report says how much."""
    head, d1, d2, q = [1, 2, 3, 4], [10] * 8, [20] * 8, [99, 98]
    rows = []
    for i, docs in enumerate(((d1, d2), (d2, d1))):
        ids = head + docs[0] + docs[1] + q
        segs = [[4, 12], [12, 20]]
        rows.append({"prompt_token_ids": ids, "num_cached_tokens": 0, "segments": segs,
                     "timestamp": float(i)})  # fmt: skip
    log = write_log(tmp_path / "seg.jsonl", rows)
    report = analyze(read_log(log, "kvstack"), AnalyzeOptions(block_size=BS, cache_sizes=[64]))
    assert report["segment_hit_rate"] == pytest.approx(16 / 32)  # the second request's two
    assert report["segment_gain"] == pytest.approx(16 / 44)  # past the 4-token prefix hit
    bad = write_log(tmp_path / "bad.jsonl", [{**rows[0], "segments": [[12, 4]]}])
    with pytest.raises(ConfigError, match="segments"):
        read_log(bad, "kvstack", strict=True)
