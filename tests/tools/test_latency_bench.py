"""``benchmarks/latency.py``'s inputs: variants parse into engine keywords (JSON values, a
JSON object with commas), and both fixed prompts are exactly 512 tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import latency


def test_variants_are_names_plus_engine_keywords() -> None:
    assert latency.parse_variant("bf16:") == ("bf16", {})
    assert latency.parse_variant("gguf:quantization=gguf") == ("gguf", {"quantization": "gguf"})
    spec = 'spec:quantization=gguf,speculative_config={"method": "ngram", "k": 4},seed=3'
    assert latency.parse_variant(spec) == (
        "spec",
        {"quantization": "gguf", "speculative_config": {"method": "ngram", "k": 4}, "seed": 3},
    )
    with pytest.raises(SystemExit):
        latency.parse_variant(":quantization=gguf")


def test_fixed_prompts_are_512_tokens() -> None:
    from kvstack.model.loader.registry import load_tokenizer

    prompts = latency.build_prompts()
    assert set(prompts) == {"repetitive", "open"}
    assert all(len(ids) == latency.PROMPT_TOKENS for ids in prompts.values())
    text = load_tokenizer("default").decode(prompts["repetitive"])
    assert text.endswith("Repeat the code above exactly:\n") and "BLAKE2b" in text
    assert latency.build_prompts() == prompts  # seeded: the same prompts every run
    prose = latency.build_prompts("default", text=True)  # real text instead of random words
    assert set(prose) == {"repetitive", "text"} and len(prose["text"]) == latency.PROMPT_TOKENS
    words = load_tokenizer("default").decode(prose["text"])
    assert words.endswith("Summarize the text above.\n") and "Python" in words


def test_a_speculating_variant_is_compared_with_its_base_run_by_run() -> None:
    def result(name: str, tok_s: list[float]) -> dict:
        med = sorted(tok_s)[len(tok_s) // 2]
        open_ = {"decode_tok_s": med, "decode_tok_s_all": tok_s, "ttft_s": 0.1}
        return {"name": name, "prompts": {"open": open_}}

    # run 3 of the base and runs 2-3 of the variant fell in fast minutes: the ratio of
    # medians (1.25) hides that the variant was slower in two of three side-by-side runs
    results = [result("gguf", [100.0, 100.0, 130.0]), result("gguf+ngram", [97.0, 125.0, 126.0])]
    latency.add_ratios(results)
    p = results[1]["prompts"]["open"]
    assert p["decode_vs_base"] == 1.25
    assert p["decode_vs_base_runs"] == [0.97, 1.25, 0.969]
    assert p["decode_vs_base_paired"] == 0.97
    assert "decode_vs_base" not in results[0]["prompts"]["open"]
    table = latency.markdown(
        {
            "results": [{**r, "info": {}, "engine": "kvstack"} for r in results],
            "machine": {},
            "date": "d",
            "threads": 2,
            "new_tokens": 4,
            "runs": 3,
            "loadavg_before": 0,
            "loadavg_after": 0,
            "file": "f",
        }
    )
    assert "1.250x (0.970x)" in table
