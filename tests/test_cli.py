"""The `kvstack` command: help, JSONL output, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstack.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in (
        "--kv-cache-memory",
        "--num-blocks",
        "--block-size",
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--max-model-len",
        "--dtype",
        "--temperature",
        "--top-p",
    ):
        assert opt in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "2"], "top_p"),
        (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
        (["generate"], "no prompts"),
        (["generate", "hi", "--kv-cache-memory", "lots"], "memory size"),
    ],
)
def test_errors_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstack: error:"), err
    assert needle in lines[0]


def test_non_utf8_input_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'"caf\xe9"\n')
    code, _, err = run(capsys, "generate", "--input", str(bad))
    assert code == 2 and "UTF-8" in err and len(err.strip().splitlines()) == 1


def test_generate_jsonl(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(
        json.dumps({"prompt": "The capital of France is"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi!"}]})
        + "\n",
        encoding="utf-8",
    )
    out_path = tmp_path / "out.jsonl"
    code, _, err = run(
        capsys,
        "generate",
        "Hello there",
        "--input",
        str(inp),
        "--output",
        str(out_path),
        "--max-tokens",
        "6",
        "--token-ids",
        "-q",
    )
    assert code == 0, err
    recs = [json.loads(line) for line in out_path.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert 1 <= r["num_output_tokens"] <= 6 and len(r["token_ids"]) == r["num_output_tokens"]
        assert r["finish_reason"] in ("length", "stop")


def test_empty_prompt_cli(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "generate", "", "--max-tokens", "2", "-q")
    assert code == 2 and "empty" in err


def test_chat_streams_and_exits_on_eof(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 2+2?\n/reset\n\nName a colour.\n"))
    code, out, _ = run(capsys, "chat", "--max-tokens", "8", "--temperature", "0")
    assert code == 0
    replies = [line for line in out.splitlines() if "bot> " in line]
    assert len(replies) == 2 and all(r.split("bot> ", 1)[1].strip() for r in replies)
