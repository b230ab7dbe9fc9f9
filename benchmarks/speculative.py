"""Single-stream decode with and without speculation: n-gram, or a draft model
(the goals and results: ``docs/speculative.md``).

One request at a time: a 512-token prompt, 256 new tokens, greedy, ``ignore_eos`` (every
run decodes exactly 256 tokens), the default model (SmolLM2-135M Q4_1 GGUF, bf16), on
two prompts, both in the model's chat template:

* *repetitive*: the text of ``src/kvstack/kv/hashing.py`` (cut to fit) followed by
  "Repeat the code above exactly:";
* *non-repetitive*: 512 tokens of random words (fixed seed), then an open question.

kvstack without speculation and with ``--speculative-config`` variants (prompt lookup;
the model drafted by its own GGUF weights kept packed, ``spec/draft_model.py``), each an
``LLMEngine`` built once in this process; repetitions alternate the variants (so a
burst of load from others hits all of them) and the figures are medians (and minima of
the decode time) of ``--runs`` runs. Decode tok/s = (tokens - 1) / (time from the first
token to the last). Also: acceptance rate and mean acceptance length (vLLM's
definitions, ``spec/stats.py``), the proposer's cost per call (a draft model's forwards
included), whether the greedy output
equals the plain run's, the cores other processes used meanwhile (``LoadMeter``), CPU
model and ISA flags. Writes ``benchmarks/results/speculative-<date>.json``;
``--readme`` then re-renders the docs' measured tables from the results
(``benchmarks/docs_tables.py``).

    PYTHONPATH=src python benchmarks/speculative.py --runs 5 --readme
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench_common import (
    REPO_ROOT,
    RESULTS_DIR,
    LoadMeter,
    log,
    render_docs,
    wait_for_idle,
    write_json,
)
from kvstack import LLM, SamplingParams
from kvstack.engine.llm_engine import LLMEngine

PROMPT_TOKENS = 512
NEW_TOKENS = 256
QUESTION = (
    "Given everything above, what do you think is the most important idea humans have "
    "ever had, and why?"
)
WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "river stone lamp garden window silver orange market winter paper music forest table "
    "engine cloud tiger letter bridge candle mirror harbor pencil valley rocket island "
    "basket meadow thunder velvet planet marble copper shadow lantern violin desert "
    "feather compass blanket summer ladder kitten puzzle anchor orchard castle saddle "
    "glacier pepper quiet rapid gentle narrow bright hollow ancient broken golden humble"
).split()
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram k4 n2-5": {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "ngram k8 n2-5": {"num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    # The same without pausing after repeated misses (``spec/speculator.pause_after``).
    "ngram k8 n2-5 no pause": {
        "num_speculative_tokens": 8,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        "max_pause": 0,
    },
    # The model drafted by its own Q4_1 / Q8_0 weights kept packed (``quant_gemv``).
    "draft gguf k4": {"model": "default", "quantization": "gguf", "num_speculative_tokens": 4},
    "draft gguf k6": {"model": "default", "quantization": "gguf", "num_speculative_tokens": 6},
}


def chat_prompt(llm: LLM, text: str) -> list[int]:
    """``text`` as one user turn in the model's chat template, tokenized."""
    ids = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    assert isinstance(ids, list)
    return ids


def build_prompts(llm: LLM) -> dict[str, list[int]]:
    """The two prompts, each ``PROMPT_TOKENS`` long (the code or the words cut to fit)."""
    tok = llm.tokenizer
    code = (REPO_ROOT / "src/kvstack/kv/hashing.py").read_text()
    tail = "\n\nRepeat the code above exactly:"
    frame = len(chat_prompt(llm, tail))
    code_ids = tok.encode(code, add_special_tokens=False)[: PROMPT_TOKENS - frame]
    repetitive = chat_prompt(llm, tok.decode(code_ids) + tail)
    rng = random.Random(16)
    words: list[str] = []
    while len(chat_prompt(llm, " ".join(words) + "\n\n" + QUESTION)) <= PROMPT_TOKENS:
        words.append(rng.choice(WORDS))
    other = chat_prompt(llm, " ".join(words[:-1]) + "\n\n" + QUESTION)
    return {"repetitive": repetitive, "non-repetitive": other}


def one_run(eng: LLMEngine, prompt: list[int]) -> dict[str, Any]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    before = dict(eng.stats().spec_decode)
    t0 = time.perf_counter()
    eng.add_request("bench", None, sp, prompt_token_ids=prompt)
    t_first = None
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if t_first is None and out.outputs[0].token_ids:
                t_first = time.perf_counter()
            tokens = out.outputs[0].token_ids
    t_end = time.perf_counter()
    assert t_first is not None and len(tokens) == NEW_TOKENS
    after = eng.stats().spec_decode
    run: dict[str, Any] = {
        "ttft_s": t_first - t0,
        "decode_tok_s": (len(tokens) - 1) / (t_end - t_first),
        "tokens": tokens,
    }
    if after:
        drafts = after["num_drafts"] - before.get("num_drafts", 0)
        draft_tokens = after["num_draft_tokens"] - before.get("num_draft_tokens", 0)
        accepted = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
        run |= {
            "drafts": drafts,
            "draft_tokens": draft_tokens,
            "accepted": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        }
    return run


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_model": platform.processor()}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        info["cpu_model"] = next(ln for ln in lines if ln.startswith("model name")).split(":")[1]
        info["cpu_model"] = info["cpu_model"].strip()
        flags = next(ln for ln in lines if ln.startswith("flags")).split()
        info["isa_flags"] = sorted(f for f in flags if f.startswith(("avx512", "amx", "avx2")))
    except (OSError, StopIteration):
        info["isa_flags"] = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    info["git_commit"] = commit or None
    return info


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tok_s = [r["decode_tok_s"] for r in runs]
    out: dict[str, Any] = {
        "decode_tok_s_median": statistics.median(tok_s),
        "decode_tok_s_best": max(tok_s),
        "decode_tok_s_runs": [round(x, 2) for x in tok_s],
        "ttft_s_median": statistics.median(r["ttft_s"] for r in runs),
    }
    if "acceptance_rate" in runs[0]:
        out["acceptance_rate"] = statistics.median(r["acceptance_rate"] for r in runs)
        out["mean_acceptance_length"] = statistics.median(r["mean_acceptance_length"] for r in runs)
    return out


def markdown_table(result: dict[str, Any]) -> str:
    """The result as a markdown table (printed; the docs' copy is ``docs_tables.py``'s)."""
    m = result["machine"]
    lines = [
        f"Single stream, {PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, greedy, bf16, "
        f"default GGUF; commit {m['git_commit']}, {m['cpu_model']} "
        f"({', '.join(m['isa_flags']) or 'no AVX-512/AMX'}), {result['threads']} threads; "
        f"medians of {result['runs']} alternating runs in one process (others' load "
        f"{result['other_cores']:.2f} cores on average). Ratio: the same run's plain median.",
        "",
        "| prompt | variant | decode tok/s | ratio | acceptance | mean accepted length | "
        "same tokens as plain | µs per proposal |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for prompt, variants in result["prompts"].items():
        plain = variants["plain"]["decode_tok_s_median"]
        for name, v in variants.items():
            acc = f"{v['acceptance_rate']:.0%}" if "acceptance_rate" in v else "-"
            mal = f"{v['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in v else "-"
            us = result["propose_us"].get(name)
            lines.append(
                f"| {prompt} | {name} | {v['decode_tok_s_median']:.1f} | "
                f"{v['decode_tok_s_median'] / plain:.2f}x | {acc} | {mal} | {v['same_as_plain']} | "
                f"{'-' if us is None else f'{us:.0f}'} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--quantization",
        default="none",
        help="the target's weights (kvstack's --quantization: none, int8, int4, gguf)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--readme", action="store_true")
    ap.add_argument("--wait-idle", type=float, default=60.0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    for name in [v for v in VARIANTS if v not in args.variants and v != "plain"]:
        del VARIANTS[name]
    import torch

    engines: dict[str, LLM] = {}
    for name, spec in VARIANTS.items():
        cfg = None if spec is None else {**({} if "model" in spec else {"method": "ngram"}), **spec}
        max_pause = None if cfg is None else cfg.pop("max_pause", None)
        engines[name] = LLM("default", dtype=args.dtype, max_model_len=1024,
                            quantization=args.quantization, speculative_config=cfg)  # fmt: skip
        if max_pause is not None:
            assert engines[name].engine.speculator is not None
            engines[name].engine.speculator.max_pause = max_pause
    prompts = build_prompts(engines["plain"])
    log(f"prompts: {', '.join(f'{k} {len(v)} tokens' for k, v in prompts.items())}")
    for llm in engines.values():  # warm-up: kernels, allocator, first-call costs
        one_run(llm.engine, prompts["repetitive"][:64])
        llm.reset_prefix_cache()
    waited = wait_for_idle(args.wait_idle)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        p: {v: [] for v in VARIANTS} for p in prompts
    }
    with LoadMeter() as load:
        for rep in range(args.runs):
            for p, ids in prompts.items():
                for name, llm in engines.items():
                    llm.reset_prefix_cache()  # every run prefills its whole prompt
                    r = one_run(llm.engine, ids)
                    runs[p][name].append(r)
                    log(f"run {rep} {p:15s} {name:15s} {r['decode_tok_s']:6.1f} tok/s")
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "quantization": args.quantization,
        "runs": args.runs,
        "waited_for_idle_s": round(waited, 1),
        "other_cores": load.other_cores,
        "prompt_tokens": {p: len(ids) for p, ids in prompts.items()},
        "new_tokens": NEW_TOKENS,
        "variants": {k: v for k, v in VARIANTS.items()},
        "prompts": {},
    }
    for p in prompts:
        ref = runs[p]["plain"][0]["tokens"]
        result["prompts"][p] = {}
        for name in VARIANTS:
            s = summarize(runs[p][name])
            s["same_as_plain"] = all(r["tokens"] == ref for r in runs[p][name])
            s["ratio_vs_plain"] = (
                s["decode_tok_s_median"] / statistics.median(
                    r["decode_tok_s"] for r in runs[p]["plain"])
            )  # fmt: skip
            result["prompts"][p][name] = s
    result["propose_us"] = {
        name: llm.engine.stats().spec_decode.get("propose_us_mean", 0.0)
        for name, llm in engines.items() if llm.engine.speculator is not None
    }  # fmt: skip
    out = Path(args.out) if args.out else RESULTS_DIR / f"speculative-{result['date']}.json"
    write_json(result, out)
    log(f"wrote {out}")
    print(json.dumps({p: {n: round(v["ratio_vs_plain"], 2) for n, v in d.items()}
                      for p, d in result["prompts"].items()}))  # fmt: skip
    print(markdown_table(result))
    if args.readme:
        render_docs()


if __name__ == "__main__":
    main()
