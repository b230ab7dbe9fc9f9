"""One bad log line never aborts the analysis: a 401-digit ``timestamp`` raised an uncaught
``OverflowError`` for the whole file, even without ``--strict``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstack.core.errors import ConfigError
from kvstack.tools.analyze import add_analyze_args, read_log, run_analyze

IDS = "[1, 2, 3, 4, 5, 6, 7, 8]"
BAD_STAMPS = [
    "1" + "0" * 400,  # 401 digits: float() overflows
    "NaN", "Infinity", "-1e400", "1e300", "-5", '"99999-01-01T00:00:00"',
]  # fmt: skip


def test_a_monstrous_timestamp_is_one_malformed_line(tmp_path: Path) -> None:
    lines = [f'{{"timestamp": 1.0, "prompt_token_ids": {IDS}}}']
    lines += [f'{{"timestamp": {t}, "prompt_token_ids": {IDS}}}' for t in BAD_STAMPS]
    lines.append(f'{{"timestamp": 2.0, "prompt_token_ids": {IDS}, "session_id": {"9" * 500}}}')
    lines.append(f'{{"timestamp": 3.0, "prompt_token_ids": {IDS}}}')
    log = tmp_path / "l.jsonl"
    log.write_text("\n".join(lines) + "\n")
    parsed = read_log(log)
    assert parsed.num_malformed == len(BAD_STAMPS) and len(parsed.requests) == 3
    assert all(len(why) < 200 for _, why in parsed.malformed)  # no 401-digit messages
    assert parsed.ordered_by == "timestamp"
    parser = argparse.ArgumentParser()
    add_analyze_args(parser)
    assert run_analyze(parser.parse_args([str(log), "--quiet", "--cache-size", "64"])) == 0
    with pytest.raises(ConfigError, match=":2: malformed line"):
        read_log(log, strict=True)
