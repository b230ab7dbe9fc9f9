"""The real default model (SmolLM2-135M Q4_1 GGUF) in float32: greedy decoding with
n-gram speculation, or drafted by its own packed GGUF weights, is token-identical to
decoding without it, in one batch."""

from __future__ import annotations

from kvstack import LLM, SamplingParams


def test_greedy_speculation_equals_plain_on_the_default_model() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    llm = LLM("default", dtype="float32", max_model_len=512, num_blocks=64,
              speculative_config=spec)  # fmt: skip
    prompts = [
        "red, green, blue, red, green, blue, red, green, blue, red, green,",  # it repeats
        "The three largest rivers of Europe are",
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eng = llm.engine
    speculator, eng.speculator = eng.speculator, None  # the same engine, one token per step
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    eng.speculator = speculator
    assert eng.speculator is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == plain
    stats = eng.stats().spec_decode
    assert stats["num_accepted_tokens"] >= 10, stats  # the repeated colours are accepted
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks


def test_a_draft_of_its_own_gguf_weights_keeps_greedy_output() -> None:
    """The default model drafted by its own GGUF weights kept packed (``quant_linear`` in
    float32: the same weights, other summation order): plain decoding's tokens, and nearly
    every guess kept."""
    spec = {"model": "default", "quantization": "gguf", "num_speculative_tokens": 4}
    llm = LLM("default", dtype="float32", max_model_len=512, num_blocks=64,
              speculative_config=spec)  # fmt: skip
    prompts = ["The three largest rivers of Europe are", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eng = llm.engine
    speculator, eng.speculator = eng.speculator, None
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    eng.speculator = speculator
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == plain
    stats = eng.stats().spec_decode
    assert stats["acceptance_rate"] >= 0.9 and stats["num_drafts"] >= 8, stats
    eng.check_integrity()
    assert eng.num_free_blocks == eng.kv_manager.num_blocks
