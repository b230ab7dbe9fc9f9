"""The `kvstack` command: help, JSONL output, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvstack.cli import main
from kvstack.model.kernels.isa import auto_dtype
from kvstack.spec.config import SpeculativeConfig


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


@pytest.mark.slow
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


# Non-default values of every engine option, as (flag arguments, expected value). Two
# command lines: the contiguous layout excludes the presses, codecs and offload tiers.
KEY_FILE = Path(tempfile.gettempdir()) / "kvstack-test-cli-tier.key"  # written by the test
# The default dtype is --dtype auto's choice for this CPU, so the non-default is the other.
OTHER_DTYPE = "bfloat16" if auto_dtype().dtype == "float32" else "float32"
NON_DEFAULT: list[dict[str, tuple[list[str], object]]] = [
    {
        "model": (["/models/m.gguf"], "/models/m.gguf"),
        "dtype": ([OTHER_DTYPE], OTHER_DTYPE),
        "tokenizer": (["/models/tok"], "/models/tok"),
        "chat_template": (["/models/chat.jinja"], "/models/chat.jinja"),
        "generation_config": (["vllm"], "vllm"),
        "seed": (["7"], 7),
        "quantization": (["int4"], "int4"),
        "structured_outputs_backend": (["llguidance"], "llguidance"),
        "block_size": (["32"], 32),
        "num_blocks": (["100"], 100),
        "kv_cache_memory": (["1GiB"], 1 << 30),
        "prefix_cache": (["radix"], "radix"),
        "eviction_policy": (["adaptive"], "adaptive"),
        "max_pinned_fraction": (["0.25"], 0.25),
        "kv_cache_dtype": (["int8"], "int8"),
        "kv_press": (["snapkv"], "snapkv"),
        "kv_press_ratio": (["0.5"], 0.5),
        "kv_press_every": (["16"], 16),
        "kv_offload": (["host:64MiB"], "host:64MiB"),
        "kv_offload_key_file": ([str(KEY_FILE)], str(KEY_FILE)),
        "max_num_seqs": (["4"], 4),
        "max_num_batched_tokens": (["512"], 512),
        "max_model_len": (["1024"], 1024),
        "enable_chunked_prefill": ([], False),
        "kv_cache_metrics": ([], True),
        "disable_hybrid_kv_cache_manager": ([], True),
        "kv_cache_metrics_sample": (["0.5"], 0.5),
        "segment_cache": (["none"], "none"),
        "segment_recompute_ratio": (["0.3"], 0.3),
        "segment_recompute_tokens": (["8"], 8),
        "segment_max_fraction": (["0.25"], 0.25),
    },
    {
        "kv_layout": (["contiguous"], "contiguous"),
        "prefix_cache": (["none"], "none"),
        "speculative_config": (
            ['{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'],
            SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=2),
        ),
    },
]


def test_every_engine_option_has_a_flag() -> None:
    from kvstack.cli import build_parser
    from kvstack.config.engine import EngineConfig
    from kvstack.core.options import option_specs

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for command in ("generate", "chat", "serve"):
        parser = sub.choices[command]  # type: ignore[index]
        by_dest: dict[str, Any] = {}
        for a in parser._actions:  # the option's own flag first; vLLM switches share the dest
            by_dest.setdefault(a.dest, a)
        for s in option_specs(EngineConfig):
            assert s.name in by_dest, (command, s.name)
            assert s.flag in by_dest[s.name].option_strings
            assert by_dest[s.name].help


def test_engine_config_from_cli_args_round_trips_every_option() -> None:
    from kvstack.cli import build_parser
    from kvstack.config.engine import EngineConfig
    from kvstack.core.options import option_specs

    KEY_FILE.write_bytes(b"k" * 32)  # --kv-offload-key-file is read when the config is built
    covered = set().union(*NON_DEFAULT)
    assert covered == {s.name for s in option_specs(EngineConfig)}
    flags = {s.name: s.flag for s in option_specs(EngineConfig)}
    parser = build_parser()
    for values in NON_DEFAULT:
        argv = ["generate", "hi"]
        for name, (args, _) in values.items():
            argv += [flags[name], *args]
        options = EngineConfig.from_cli_args(parser.parse_args(argv)).options()
        for name, (_, want) in values.items():
            assert options[name] == want != EngineConfig().options()[name], name
    assert EngineConfig.from_cli_args(parser.parse_args(["generate"])) == EngineConfig()


def test_serve_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstack.config.engine import EngineConfig
    from kvstack.core.options import option_specs
    from kvstack.route.ray import RayOptions
    from kvstack.serve.server import ServerOptions

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cls in (ServerOptions, RayOptions, EngineConfig):
        for s in option_specs(cls):
            assert s.flag in out, s.flag
    for opt in ("--ray", "--replicas", "--replica-cpus", "--ray-address", "--policy"):
        assert opt in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--max-waiting", "0"], "--max-waiting must be at least 1"),
        (["serve", "--port", "70000"], "--port must be in 1..65535"),
        (["serve", "--role", "prefill"], "--role prefill needs --kv-offload"),
        (["serve", "--kv-cache-memory", "lots"], "memory size"),
    ],
)
def test_serve_option_errors_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstack: error:") and needle in lines[0], err
