"""vLLM's offline API on kvstack: a vLLM script runs with only its import changed.

``LLM.generate`` takes vLLM's ``TokensPrompt`` / ``TextPrompt`` dicts, ``LLM(...)`` vLLM's
common keywords (``kvstack.config.vllm_args``), ``use_tqdm`` is on by default, and vLLM's
``--kv-cache-dtype`` spellings map onto kvstack's codecs.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstack import LLM, SamplingParams
from kvstack.config.engine import EngineConfig
from kvstack.config.vllm_args import VLLM_KEYWORDS, available_memory, meminfo, translate
from kvstack.core.errors import ConfigError, InvalidRequestError
from kvstack.model.kernels.isa import auto_dtype
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder

OPTS: dict[str, Any] = {"dtype": "float32", "num_blocks": 64, "max_model_len": 256}

# A vLLM token-id script as vLLM's docs write it; the test swaps only the import line.
VLLM_SCRIPT = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL, enable_prefix_caching=True, enforce_eager=True, trust_remote_code=True,
          tensor_parallel_size=1, max_model_len=256, seed=0, dtype="float32", num_blocks=64)
params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
prompts = [{"prompt_token_ids": [1, 5, 9, 13, 17]}, {"prompt_token_ids": [2, 4, 6]}]
for out in llm.generate(prompts, params):
    print(out.prompt_token_ids, list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    return write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    yield LLM(str(model_dir), **OPTS)


def test_vllm_script_runs_with_only_the_import_changed(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = VLLM_SCRIPT.replace("from vllm import", "from kvstack import")
    assert script != VLLM_SCRIPT
    exec(compile(textwrap.dedent(script), "vllm_script.py", "exec"), {"MODEL": str(model_dir)})
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert lines[0].startswith("[1, 5, 9, 13, 17] [") and lines[0].endswith("] length")
    assert lines[1].startswith("[2, 4, 6] [") and len(lines) == 2
    assert "Processed prompts" in err  # vLLM's progress bar, on by default


def test_tokens_and_text_prompts_and_lists_of_them(llm: LLM) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = [3, 7, 11, 15, 19, 23]
    want = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)[0]
    for prompts in ({"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], [ids], ids):
        out = llm.generate(prompts, sp, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want.outputs[0].token_ids
    text = llm.tokenizer.decode(ids)
    mixed = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids
    salted = llm.generate({"prompt_token_ids": ids * 4, "cache_salt": "a"}, sp, use_tqdm=False)
    assert salted[0].num_cached_tokens == 0  # a salt never shares the unsalted prefix
    llm.engine.check_integrity()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt_token_ids": [1], "multi_modal_data": {}}, "'multi_modal_data' is not supported"),
        ({"prompt_token_ids": [1], "foo": 1}, "unknown TokensPrompt key 'foo'"),
        ({"prompt_token_ids": "1 2"}, "must be a list of integers"),
        ({"text": "hi"}, "needs 'prompt' (text) or 'prompt_token_ids'"),
        ({"prompt": 3}, "'prompt' must be a string"),
        (3.5, "prompts must be"),
    ],
)
def test_bad_prompts_are_clear_errors_and_queue_nothing(
    llm: LLM, prompt: Any, message: str
) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["fine", prompt] if isinstance(prompt, dict) else prompt, use_tqdm=False)
    assert message in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="LoRA"):
        llm.generate("x", lora_request=object(), use_tqdm=False)


def test_use_tqdm_default_and_callable(llm: LLM) -> None:
    from tqdm import tqdm

    made: list[Any] = []

    def bar(**kw: Any) -> Any:
        made.append(kw)
        return tqdm(file=io.StringIO(), **kw)

    llm.generate("hello", SamplingParams(max_tokens=1), use_tqdm=bar)
    assert made and made[0]["total"] == 1
    assert LLM.generate.__kwdefaults__["use_tqdm"] is True


def test_vllm_keywords_map_or_fail_naming_the_keyword() -> None:
    assert translate({"enable_prefix_caching": False})["prefix_cache"] == "none"
    assert "prefix_cache" not in translate({"enable_prefix_caching": True})
    mem = translate({"gpu_memory_utilization": 0.25})["kv_cache_memory"]
    assert 0 < mem <= 0.25 * meminfo("MemTotal")  # vLLM CPU: weights and RSS inside
    assert mem <= 0.8 * available_memory()
    for bad, name in [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1]"),
        ({"gpu_memory_utilization": 0.5, "num_blocks": 8}, "not both"),
        ({"revision": "main"}, "no hub download"),
        ({"kv_events_config": {"enable_kv_cache_events": True}}, "only kvstack serve"),
        ({"enable_prefix_caching": True, "prefix_cache": "none"}, "contradicts"),
    ]:
        with pytest.raises(ConfigError) as e:
            translate(bad)
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="unknown quantization 'awq'; choose one of: none, int8"):
        EngineConfig.from_options(quantization="awq")  # vLLM's keyword, kvstack's schemes
    assert EngineConfig.from_options(quantization=None).quantization is None  # vLLM's default
    with pytest.raises(TypeError, match="unexpected keyword argument 'gpu_memory_utilisation'"):
        LLM("default", gpu_memory_utilisation=0.5)
    assert all(k.meaning for k in VLLM_KEYWORDS.values())
    assert "gpu_memory_utilization" in (LLM.__doc__ or "")


def test_vllm_kv_cache_dtype_and_dtype_spellings() -> None:
    assert EngineConfig.from_options(kv_cache_dtype="fp8_e4m3").cache.kv_cache_dtype == "fp8"
    assert EngineConfig.from_options(kv_cache_dtype="fp8_e5m2").cache.kv_cache_dtype == "fp8_e5m2"
    assert EngineConfig.from_options(dtype="auto").dtype == auto_dtype().dtype  # the CPU's
    # float16 / half run as bfloat16, the CPU kernels' 16-bit type (kvstack serve logs it).
    assert EngineConfig.from_options(dtype="float16").dtype == "bfloat16"
    assert EngineConfig.from_options(dtype="half").dtype == "bfloat16"
