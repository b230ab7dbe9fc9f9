"""``--dtype auto`` (the default) decided by the CPU's ISA from a fixed table, the start-up
line naming the dtype and the ISA that decided it, the warning for bfloat16 forced on a
CPU without native bf16, and a KV pool that cannot hold one sequence of
``max_model_len`` tokens (an error when the length was given, a lowered length otherwise).

The CPU is faked by replacing ``isa.cpu_flags`` (what ``auto_dtype`` reads), so every case
runs on any x86 CPU: nothing here depends on the CPU the suite runs on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvstack import LLM, SamplingParams
from kvstack.cli import build_parser, main
from kvstack.config.engine import EngineConfig
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.core.options import option_specs
from kvstack.engine.startup import dtype_note
from kvstack.model.kernels import isa
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

AVX2 = frozenset(isa.V3_FLAGS)  # AMD Zen 1-3, Intel Haswell .. Alder Lake
AVX512 = AVX2 | frozenset(isa.V4_FLAGS)  # Skylake-SP .. Ice Lake Xeons
AVX512_BF16 = AVX512 | {"avx512_bf16", "avx512_vnni"}  # AMD Zen 4/5, Cooper Lake
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}  # Sapphire Rapids
NO_AVX2 = frozenset({"sse4_2", "popcnt", "avx"})


@pytest.mark.parametrize(
    ("flags", "dtype", "level", "says"),
    [
        (NO_AVX2, "float32", "none", "no AVX2"),
        (AVX2, "bfloat16", "avx2", "CPU has avx2, no avx512_bf16/AMX: bf16 storage, float32"),
        (AVX512, "bfloat16", "avx512", "CPU has avx512f, no avx512_bf16/AMX: bf16 storage"),
        (AVX512_BF16, "bfloat16", "avx512_bf16", "avx512_bf16: bf16 runs natively"),
        (AMX, "bfloat16", "amx", "AMX-BF16 tiles: bf16 runs natively"),
    ],
)
def test_auto_picks_bf16_storage_wherever_a_kernel_widens_it(
    flags: frozenset[str], dtype: str, level: str, says: str
) -> None:
    choice = isa.auto_dtype(flags)
    native = level in ("avx512_bf16", "amx")
    assert (choice.dtype, choice.level, choice.native_bf16) == (dtype, level, native)
    assert says in choice.reason()
    assert set(isa.AUTO_DTYPE) == {"none", *isa.LEVEL_NAMES}  # every level has an entry


@pytest.mark.parametrize(("flags", "dtype"), [(NO_AVX2, "float32"), (AMX, "bfloat16")])
def test_the_default_is_auto_resolved_early(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], dtype: str
) -> None:
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    assert {s.name: s.default for s in option_specs(EngineConfig)}["dtype"] == "auto"
    assert EngineConfig().dtype == dtype  # a concrete dtype, never "auto", downstream
    assert EngineConfig.from_options(dtype="auto").dtype == dtype
    cli = EngineConfig.from_cli_args(build_parser().parse_args(["serve"]))
    assert cli.dtype == dtype and cli.replace(seed=3).dtype == dtype
    for explicit in ("bfloat16", "float32"):  # still honoured as given
        assert EngineConfig.from_options(dtype=explicit).dtype == explicit
    assert build_parser().parse_args(["profile"]).dtype == dtype


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()  # context 512
    return write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))


def startup_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvstack.engine.startup"]


def test_start_up_line_names_the_dtype_the_isa_and_the_kv_cache(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(isa, "cpu_flags", lambda: AVX2)
    with caplog.at_level(logging.INFO, logger="kvstack"):
        llm = LLM(str(tiny), num_blocks=64, block_size=8)
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.config.dtype == "bfloat16"
    (line,) = startup_records(caplog)
    text = line.getMessage()
    assert line.levelno == logging.INFO
    assert text.startswith("dtype bfloat16 (--dtype auto's choice: CPU has avx2, no avx512_bf16")
    assert "bf16 storage, float32 compute" in text and "KV cache bfloat16" in text
    level, text = dtype_note("float32", "auto", isa.auto_dtype(NO_AVX2))  # float32's KV
    assert level == logging.INFO and text.startswith("dtype float32 (--dtype auto's choice")
    assert "KV cache float32" in text and "half the tokens of bf16" in text


def test_bf16_forced_where_auto_picks_float32_runs_with_one_warning(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for flags, warned in ((NO_AVX2, True), (AVX2, False), (AVX512, False), (AVX512_BF16, False)):
        monkeypatch.setattr(isa, "cpu_flags", lambda flags=flags: flags)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvstack"):
            llm = LLM(str(tiny), dtype="bfloat16", num_blocks=64, block_size=8)
        assert llm.engine.dtype == torch.bfloat16  # allowed
        (line,) = startup_records(caplog)
        assert (line.levelno == logging.WARNING) == warned, line.getMessage()
        if warned:  # the measured cost, with the machine it was measured on
            text = line.getMessage()
            assert "without AVX2" in text and "--dtype auto picks float32" in text
        out = llm.generate(prompt_token_ids=[[1, 5, 9]], sampling_params=sp)[0]
        assert len(out.outputs[0].token_ids) == 4


def test_a_max_model_len_the_pool_cannot_hold_is_one_error(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 16 blocks of 8 tokens: 128 tokens for one sequence.
    with pytest.raises(ConfigError) as e:
        LLM(str(tiny), num_blocks=16, block_size=8, max_model_len=256)
    msg = str(e.value)
    assert "max seq len (256) is larger than the maximum number of tokens" in msg
    assert "can be stored in the KV cache (128:" in msg and "decreasing --max-model-len" in msg
    assert (
        LLM(str(tiny), num_blocks=16, block_size=8, max_model_len=128).engine.max_model_len == 128
    )
    argv = ["generate", "hi", "--model", str(tiny), "--num-blocks", "16", "--block-size", "8"]
    assert main([*argv, "--max-model-len", "256"]) == 2  # the CLI: one line, exit 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "larger than the maximum number of tokens" in lines[0], lines


def test_the_models_context_is_lowered_to_what_the_pool_holds(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstack"):
        llm = LLM(str(tiny), num_blocks=8, block_size=8)  # 64 tokens; the context is 512
    assert llm.engine.max_model_len == 64
    assert any("max_model_len lowered to 64" in r.getMessage() for r in startup_records(caplog))
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len 64"):
        llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=sp)
    fits = SamplingParams(temperature=0, max_tokens=59, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[1, 2, 3, 4, 5]], sampling_params=fits)[0]
    assert len(out.outputs[0].token_ids) == 59 and llm.engine.num_free_blocks == 8
