"""Synthetic prefix-cache workloads: determinism, lengths, structure, hit rates, I/O, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.core.errors import ConfigError
from kvstack.model.loader.registry import load_tokenizer
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.tools.workloads import (
    WORKLOADS,
    WorkloadRequest,
    WorkloadSpec,
    build_workload,
    ideal_hit_rate,
    main,
    make_workload,
    read_jsonl,
    summarize,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("default")


def near(value: float, target: float, tol: float = 0.10) -> bool:
    return abs(value - target) <= tol * target


def common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for j in range(n):
        if any(s[j] != seqs[0][j] for s in seqs[1:]):
            return j
    return n


def n_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def req(ids: list[int], rnd: int = 0, idx: int = 0) -> WorkloadRequest:
    return WorkloadRequest(f"r{idx}", ids, None, "", 8, None, rnd, idx)


# agent-loop renders tools and tool messages (tests/tools/test_agent_loop.py checks it);
# the *-shuffled ones tools and documents (test_shuffled_workloads_mark_their_pieces).
PLAIN = [w for w in WORKLOADS if w != "agent-loop" and not w.endswith("-shuffled")]


@pytest.mark.parametrize("name", PLAIN)
def test_deterministic_and_consistent(tok: Tokenizer, name: str) -> None:
    a = make_workload(name, tok, 6, seed=1)
    b = make_workload(name, tok, 6, seed=1)
    c = make_workload(name, tok, 6, seed=2)
    assert a == b
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert [r.arrival_index for r in a] == list(range(6))
    assert len({r.request_id for r in a}) == 6
    for r in a:
        assert r.max_tokens == 64 and r.messages is not None
        # The ids are exactly what the engine prefills for these messages.
        assert r.prompt_token_ids == tok.apply_chat_template(r.messages, tokenize=True)
        assert r.prompt == tok.apply_chat_template(r.messages, tokenize=False)
    # Shared text does not depend on how many requests are asked for.
    assert make_workload(name, tok, 3, seed=1)[0] == a[0]


def test_random_and_shared_prefix_lengths(tok: Tokenizer) -> None:
    rand = make_workload("random", tok, 16)
    assert all(near(len(r.prompt_token_ids), 200) for r in rand)
    assert common_prefix([r.prompt_token_ids for r in rand]) < 32

    shared = make_workload("shared-prefix", tok, 32)
    assert all(near(len(r.prompt_token_ids), 200) for r in shared)
    assert {r.session_id for r in shared} == {"group-0"}
    assert abs(common_prefix([r.prompt_token_ids for r in shared]) - 144) <= 3

    long = make_workload("shared-prefix", tok, 8, shared_prefix_len=1000, prompt_len=1100)
    assert all(near(len(r.prompt_token_ids), 1100) for r in long)
    assert near(common_prefix([r.prompt_token_ids for r in long]), 1000, 0.02)

    groups = make_workload("shared-prefix", tok, 70)  # ceil(70 / 32) = 3 groups
    assert len({r.session_id for r in groups}) == 3
    g0 = [r.prompt_token_ids for r in groups if r.session_id == "group-0"]
    g1 = [r.prompt_token_ids for r in groups if r.session_id == "group-1"]
    assert abs(common_prefix(g0) - 144) <= 3 and common_prefix([g0[0], g1[0]]) < 16


def test_multi_turn_structure(tok: Tokenizer) -> None:
    reqs = make_workload("multi-turn", tok, 40)
    assert summarize(reqs)["num_sessions"] == 8 and summarize(reqs)["num_rounds"] == 5
    # Arrivals are round-major and interleave the conversations within a round.
    assert [r.round for r in reqs] == sorted(r.round for r in reqs)
    assert [r.session_id for r in reqs[:8]] == [f"conv-{c}" for c in range(8)]
    by_conv: dict[str | None, list[WorkloadRequest]] = {}
    for r in reqs:
        by_conv.setdefault(r.session_id, []).append(r)
    for turns in by_conv.values():
        assert [t.round for t in turns] == list(range(5))
        for k, t in enumerate(turns):
            assert t.messages is not None and len(t.messages) == 2 + 2 * k
            if k:  # turn k resends turn k-1's prompt tokens exactly
                prev = turns[k - 1].prompt_token_ids
                assert t.prompt_token_ids[: len(prev)] == prev
        msgs = turns[-1].messages
        assert msgs is not None
        assert near(n_tokens(tok, msgs[0]["content"]), 400)
        assert all(near(n_tokens(tok, m["content"]), 60) for m in msgs if m["role"] == "user")
        assert all(near(n_tokens(tok, m["content"]), 80) for m in msgs if m["role"] == "assistant")
    # All conversations share the system prompt.
    first = [r.prompt_token_ids for r in reqs if r.round == 0]
    assert common_prefix(first) >= 400
    # 42 requests: 9 conversations, the last one cut to 2 turns.
    cut = make_workload("multi-turn", tok, 42)
    assert len(cut) == 42 and summarize(cut)["num_sessions"] == 9
    assert sorted(r.round for r in cut if r.session_id == "conv-8") == [0, 1]


def test_few_shot_rag_agent_structure(tok: Tokenizer) -> None:
    few = make_workload("few-shot", tok, 8)
    assert {r.session_id for r in few} == {"family-0", "family-1"}
    msgs = few[0].messages
    assert msgs is not None and len(msgs) == 1 + 2 * 8 + 1
    shot = n_tokens(tok, msgs[1]["content"]) + n_tokens(tok, msgs[2]["content"])
    assert near(shot, 100) and near(n_tokens(tok, msgs[-1]["content"]), 30)

    rag = make_workload("rag-qa", tok, 64)
    docs = [r.session_id for r in rag]
    assert docs.count("doc-0") > docs.count("doc-3") > 0  # Zipf-like skew
    assert all(near(len(r.prompt_token_ids), 1075) for r in rag)
    two = make_workload("rag-qa", tok, 8, docs_per_request=2)
    assert all(near(len(r.prompt_token_ids), 2075) for r in two)

    agent = make_workload("agent-tools", tok, 12, num_turns=3)
    system = agent[0].messages[0]["content"] if agent[0].messages else ""
    block = system[system.index("<tools>") : system.index("</tools>") + len("</tools>")]
    assert near(n_tokens(tok, block), 1500)
    assert summarize(agent)["num_rounds"] == 3 and summarize(agent)["num_sessions"] == 4
    for r in agent:
        if r.round:
            prev = next(p for p in agent if (p.session_id, p.round) == (r.session_id, r.round - 1))
            assert r.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids


def test_ideal_hit_rate_by_hand() -> None:
    a = req(list(range(1, 11)), idx=0)  # 10 tokens: nothing cached yet
    b = req([*range(1, 9), 99, 98, 97], idx=1)  # shares blocks [1-4][5-8] -> 8
    c = req(list(range(1, 9)), idx=2)  # whole prompt cached, but at most (8-1)//4*4 = 4
    assert ideal_hit_rate([a, b, c], block_size=4) == pytest.approx(12 / 29)
    assert ideal_hit_rate([a], block_size=4) == 0.0
    assert ideal_hit_rate([]) == 0.0
    # Rounds run in order: a round-1 request listed first still sees round 0's blocks.
    late = req(list(range(1, 11)), rnd=1, idx=0)
    early = req(list(range(1, 11)), rnd=0, idx=1)
    assert ideal_hit_rate([late, early], block_size=4) == pytest.approx(8 / 20)
    with pytest.raises(ConfigError):
        ideal_hit_rate([a], block_size=0)


def test_ideal_hit_rates_at_defaults(tok: Tokenizer) -> None:
    rates = {
        "multi-turn": ideal_hit_rate(make_workload("multi-turn", tok, 40)),
        "few-shot": ideal_hit_rate(make_workload("few-shot", tok, 32)),
        "shared-prefix": ideal_hit_rate(make_workload("shared-prefix", tok, 32)),
        "random": ideal_hit_rate(make_workload("random", tok, 32)),
        "rag-qa": ideal_hit_rate(make_workload("rag-qa", tok, 32)),
        "agent-tools": ideal_hit_rate(make_workload("agent-tools", tok, 32)),
    }
    assert rates["multi-turn"] >= 0.80
    assert rates["few-shot"] >= 0.90
    assert rates["shared-prefix"] == pytest.approx(31 / 32 * 144 / 200, abs=0.01)
    assert rates["random"] < 0.15
    assert rates["rag-qa"] > 0.8 and rates["agent-tools"] > 0.9


def test_jsonl_round_trip_and_summary(tok: Tokenizer, tmp_path: Path) -> None:
    reqs = [*make_workload("multi-turn", tok, 4, num_turns=2), req([5, 6, 7], idx=4)]
    path = tmp_path / "w.jsonl"
    write_jsonl(reqs, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5
    assert rows[0]["body"] == {"messages": reqs[0].messages, "max_tokens": 64}
    assert rows[-1]["body"] == {"prompt": "", "max_tokens": 8} and "messages" not in rows[-1]
    assert read_jsonl(path) == reqs
    s = summarize(reqs)
    keys = {"num_requests", "prompt_tokens_total", "prompt_tokens_mean", "prompt_tokens_min"}
    assert keys | {"prompt_tokens_max", "num_sessions", "num_rounds", "ideal_hit_rate"} <= set(s)
    assert s["num_requests"] == 5 and s["prompt_tokens_min"] == 3 and s["num_rounds"] == 2


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "few.jsonl"
    argv = ["few-shot", "--num-requests", "4", "--seed", "3", "--max-tokens", "16"]
    assert main([*argv, "--out", str(out), "--set", "shots=2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["workload"] == "few-shot" and summary["num_requests"] == 4
    reqs = read_jsonl(out)
    assert len(reqs) == 4 and all(r.max_tokens == 16 for r in reqs)
    with pytest.raises(SystemExit) as e:
        main(["no-such-workload"])
    assert e.value.code != 0
    assert main(["random", "--set", "shots=2"]) == 2  # knob of another workload
    assert "does not apply" in capsys.readouterr().err


def test_config_errors(tok: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="valid names: random, shared-prefix, multi-turn"):
        make_workload("nope", tok, 4)
    bad: list[dict[str, object]] = [
        {"num_requests": 0},
        {"max_tokens": 0},
        {"prompt_len": -1},
        {"shared_prefix_len": 4},  # shorter than the template header
        {"shared_prefix_len": 300},  # longer than prompt_len
        {"num_groups": 0},
        {"shots": 2},  # not a shared-prefix knob
        {"bogus": 1},
    ]
    for kwargs in bad:
        args = {"num_requests": 4, **kwargs}
        with pytest.raises(ConfigError):
            make_workload("shared-prefix", tok, **args)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        make_workload("rag-qa", tok, 4, docs_per_request=5)
    with pytest.raises(ConfigError):
        build_workload(WorkloadSpec("multi-turn", 4, user_len=-5), tok)


def test_python_m_help() -> None:
    """``python -m kvstack.tools.workloads --help``: the package's ``__main__`` runs."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstack.tools.workloads", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m kvstack.tools.workloads")
    assert "--num-requests" in out


@pytest.mark.parametrize("name", ["agent-tools-shuffled", "rag-shuffled"])
def test_shuffled_workloads_mark_their_pieces(tok: Tokenizer, name: str) -> None:
    """Segment reuse: the same pieces in other subsets and orders; ids and segment ranges are
    what the server computes from the body; a piece has the same ids wherever it sits."""
    from kvstack.tools.workloads.shuffled import segment_ids

    work = make_workload(name, tok, 12, seed=1)
    assert work == make_workload(name, tok, 12, seed=1)
    assert make_workload(name, tok, 3, seed=1)[0] == work[0]
    pieces: dict[tuple[int, ...], int] = {}
    for r in work:
        extra = r.body_extra or {}
        assert r.messages is not None and r.segments
        ids, spans = segment_ids(tok, r.messages, extra.get("tools"), extra.get("documents"))
        assert r.prompt_token_ids == ids and r.segments == [list(s) for s in spans]
        n = len(extra.get("tools") or extra.get("documents") or [])
        assert len(r.segments) == n and (3 <= n <= 8 if "tools" in extra else 3 <= n <= 5)
        for s, e, *primer in r.segments:
            piece = tuple(ids[s:e])
            pieces[piece] = pieces.get(piece, 0) + 1
            if "tools" in extra:
                assert 110 <= e - s <= 260  # 120-250 rendered tokens, within a few
                assert primer and len(primer[0]) > 100  # the tool primer (an example tool)
            else:
                assert not primer  # documents have none
    assert max(pieces.values()) > 1  # pieces recur, at other offsets
