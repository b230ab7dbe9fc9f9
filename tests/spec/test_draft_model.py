"""Speculative decoding with a draft model (``spec/draft_model.py``, ``spec/drafter.py``).

Tiny random models in float32. The draft writes its rows into the target's KV cache, so
what is checked: greedy output token-identical to plain decoding under batching,
chunked prefill, prefix hits, preemption, an int8 KV codec and a sliding-window model
(hybrid KV manager); a draft of the target's own weights is always accepted (so the
draft rows really are the draft's: placeholders would be rejected); seeded sampling
gives plain decoding's tokens; a draft of another KV shape and bad configs are one
``ConfigError``. ``check_integrity()`` after every step (``run``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_spec_engine import GREEDY, prompts, reference, run

from kvstack import LLM
from kvstack.core.errors import ConfigError
from kvstack.core.request import SamplingParams
from kvstack.spec import PROPOSERS
from kvstack.spec.config import SpeculativeConfig, parse_speculative_config
from kvstack.testing.families import tiny_family_config
from kvstack.testing.tiny_models import random_llama_weights, tiny_llama_config, write_hf_folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama_config()
    return write_hf_folder(tmp_path_factory.mktemp("tiny") / "hf", cfg, random_llama_weights(cfg))


def drafted(model_dir: Path, quantization: str = "none", k: int = 4, **opts: object) -> LLM:
    spec = {"model": str(model_dir), "num_speculative_tokens": k, "quantization": quantization}
    opts = {"num_blocks": 256, **opts}
    return LLM(str(model_dir), dtype="float32", seed=0, speculative_config=spec, **opts)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 3}, '"model" names the draft'),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, '"model" names'),
        ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "int8"},
         "the draft model's"),
        ({"model": "x", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
         "is for method ngram"),
        ({"model": 3, "num_speculative_tokens": 3}, "model must be a string"),
        ({"model": "x"}, "needs num_speculative_tokens"),
        ({"model": "x", "num_speculative_tokens": 0}, "positive integer"),
    ],
)  # fmt: skip
def test_bad_draft_configs_are_one_clear_error(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_speculative_config(value)


def test_a_model_without_a_method_is_vllms_draft_model() -> None:
    c = parse_speculative_config('{"model": "default", "num_speculative_tokens": 4}')
    assert c == SpeculativeConfig("draft_model", 4, model="default")
    c = parse_speculative_config({"method": "draft_model", "model": "m", "quantization": "gguf",
                                  "num_speculative_tokens": 2})  # fmt: skip
    assert (c.method, c.model, c.quantization) == ("draft_model", "m", "gguf")
    assert set(PROPOSERS.names()) == {"ngram", "draft_model"}


def test_a_draft_of_the_target_weights_is_always_accepted(model_dir: Path) -> None:
    ps = prompts()
    want = reference(model_dir, ps, [GREEDY] * len(ps))
    spec = drafted(model_dir, k=3)
    eng = spec.engine
    eng.speculator.max_pause = 0  # type: ignore[union-attr]
    assert run(eng, ps, [GREEDY] * len(ps), stagger=2) == want
    sd = eng.stats().spec_decode
    assert sd["num_drafts"] > 20 and sd["acceptance_rate"] == 1.0, sd
    assert eng.runner.drafter is not None and eng.runner.drafter.forwards >= 3 * 10


def test_a_quantized_draft_keeps_greedy_output_everywhere(model_dir: Path) -> None:
    """int4 draft weights (about half of its guesses kept): batched and staggered,
    prefill in chunks of 16, then all at once on prefix hits, then a pool too small for
    all (preemption), then int8 KV."""
    ps = prompts()
    sps = [GREEDY] * len(ps)
    want = reference(model_dir, ps, sps)
    eng = drafted(model_dir, "int4", max_num_batched_tokens=16, block_size=8).engine
    assert run(eng, ps, sps, stagger=3) == want
    assert run(eng, ps, sps) == want
    stats = eng.stats()
    assert stats.prefix_hit_tokens > 0 and stats.spec_decode["num_accepted_tokens"] > 20
    small = drafted(model_dir, "int8", num_blocks=30, block_size=8, max_num_seqs=5).engine
    assert run(small, ps, sps) == want
    assert small.scheduler.num_preemptions_total > 0
    plain_int8 = LLM(str(model_dir), dtype="float32", num_blocks=256, kv_cache_dtype="int8")
    want8 = [plain_int8.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0]
             .outputs[0].token_ids for p in ps]  # fmt: skip
    eng8 = drafted(model_dir, "int8", kv_cache_dtype="int8").engine
    assert run(eng8, ps, sps) == want8


def test_seeded_sampling_gives_the_tokens_of_plain_decoding(model_dir: Path) -> None:
    ps = prompts()[:3]
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    want = reference(model_dir, ps[:1], [sp])[0]
    eng = drafted(model_dir, "int8").engine
    assert run(eng, ps, [sp, other, other], stagger=2)[0] == want
    assert eng.stats().spec_decode["num_accepted_tokens"] > 0


def test_a_sliding_window_model_drafts_through_the_hybrid_manager(tmp_path: Path) -> None:
    cfg = tiny_family_config("mistral", sliding_window=8)
    path = write_hf_folder(tmp_path / "mistral", cfg, random_llama_weights(cfg, seed=11))
    ps = [p[:40] for p in prompts()]
    sps = [GREEDY] * len(ps)
    want = reference(path, ps, sps)
    eng = drafted(path, "int8", block_size=4).engine
    assert eng.kv_manager.__class__.__name__ != "KVCacheManager"  # the hybrid manager
    for i, p in enumerate(ps):
        eng.add_request(f"q{i}", None, GREEDY, prompt_token_ids=p)
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
        eng.check_integrity()
    assert [done[f"q{i}"] for i in range(len(ps))] == want
    assert eng.num_free_blocks == eng.kv_manager.num_blocks
    assert eng.stats().spec_decode["num_accepted_tokens"] > 0


def test_a_draft_of_another_kv_shape_is_refused(model_dir: Path, tmp_path: Path) -> None:
    cfg = tiny_llama_config(num_layers=1)
    other = write_hf_folder(tmp_path / "other", cfg, random_llama_weights(cfg))
    spec = {"model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match=r"target's KV shape and vocabulary .*num_layers 1"):
        LLM(str(model_dir), dtype="float32", num_blocks=64, speculative_config=spec)
