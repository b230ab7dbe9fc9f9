"""The run of ``kvstack eval``: the baseline, then every variant, one engine at a time.

Each variant gets a fresh :class:`~kvstack.engine.llm.LLM` (the previous one is freed first) with
the same number of KV blocks, so scheduling (and with it the numerics of batched steps)
is identical and differences come from the codec or press alone. The baseline's
log-distributions wait in a temporary directory: at most two ``[n, vocab]`` matrices are
in memory. :func:`run_eval` returns the JSON-ready report that :mod:`.report` formats.
"""

from __future__ import annotations

import gc
import platform
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvstack.tools.eval.report as rep
from kvstack.tools.eval.config import BASELINE, CORPUS_KINDS, EvalConfig, codec_variant
from kvstack.tools.eval.corpus import (
    EvalText,
    generated_corpus,
    make_corpus,
    make_text_ids,
    real_corpus,
)
from kvstack.tools.eval.tasks import (
    DECODE_OUTPUT_TOKENS,
    DECODE_PROMPT_TOKENS,
    NEEDLE_TASK,
    NeedleCase,
    decode_throughput,
    greedy_params,
    needle_cases,
    needle_style_for,
    run_needle,
)

if TYPE_CHECKING:
    from kvstack.engine.llm import LLM


def _kv_numbers(llm: LLM, memory: int, max_seqs: int, context: int) -> dict[str, Any]:
    """Bytes per token of one table (every layer keeps every token) and what ``memory``
    holds; with the hybrid KV manager (sliding-window layers) also what one sequence of
    ``context`` tokens holds per token (``KVGroups.pages_held``) and the tokens of such
    sequences that fit."""
    import torch

    from kvstack.kv.storage import KVStorage

    eng = llm.engine
    mc, bs, codec = eng.model_config, eng.config.cache.block_size, eng.config.cache.kv_cache_dtype
    blocks = KVStorage.num_blocks_for_memory(mc, bs, eng.dtype, memory, codec, max_seqs)
    bf16 = KVStorage.num_blocks_for_memory(mc, bs, torch.bfloat16, memory, "auto", max_seqs)
    out: dict[str, Any] = {
        "bytes_per_token": eng.kv_bytes_per_token,
        "tokens_in_memory": blocks * bs,
        "capacity_ratio": blocks / bf16,
    }
    groups = eng.kv_groups
    if groups is not None and groups.hybrid:
        pages = groups.pages_held(context, bs)
        share = pages * groups.layers_per_page / (groups.num_layers * -(-context // bs))
        out["held"] = {
            "context": context,
            "bytes_per_token": eng.kv_bytes_per_token * share,
            "tokens_in_memory": int(blocks * groups.num_groups * context / pages),
        }
    return out


def _quality(
    llm: LLM, texts: list[EvalText], tmp: Path, baseline: bool, tick: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Teacher-forced comparison of every text with the baseline's saved distributions."""
    import torch

    raw = []
    for i, text in enumerate(texts):
        ids, start = text.token_ids, len(text.token_ids) // 2
        lp = llm.score(ids, start)
        path = tmp / f"text{i}.pt"
        if baseline:
            torch.save(lp, path)
        base = lp if baseline else torch.load(path)
        q = rep.compare_logprobs(base, lp, torch.tensor(ids[start:]))
        del lp, base
        raw.append({"context": text.context, "index": text.index, **q})
        tick(f"score {text.context}")
    return raw


@dataclass
class _Inputs:
    """What every variant runs on: identical inputs and the same number of KV blocks."""

    texts: list[EvalText]
    cases: list[NeedleCase]
    needle_style: str
    decode_prompts: list[list[int]]
    max_seqs: int
    num_blocks: int


def _inputs(config: EvalConfig, tok: Any) -> _Inputs:
    """The corpus, the needle cases, the speed test's prompts and the KV blocks they need."""
    from kvstack.engine.llm import LLM

    if config.corpus == "generated":
        gen = LLM(config.model, dtype=config.dtype, seed=config.seed, prefix_cache="none")
        texts = generated_corpus(gen, config.contexts, config.num_texts, config.seed)
        del gen
        gc.collect()
    elif config.corpus == "real":
        texts = real_corpus(tok, config.contexts, config.num_texts, config.seed)
    else:
        texts = make_corpus(tok, config.contexts, config.num_texts, config.seed)
    style = needle_style_for(tok)
    cases = needle_cases(
        tok,
        config.needle_lengths,
        config.needle_depths,
        config.needle_trials,
        config.seed,
        style=style,
    )
    rng = random.Random(f"kvstack-eval-decode-{config.seed}")
    decode_prompts = [make_text_ids(tok, DECODE_PROMPT_TOKENS, rng) for _ in range(config.batch)]
    bs, max_seqs = config.block_size, max(config.batch, 8)
    need = max(
        sum(t.context // 2 + config.greedy_tokens + bs for t in texts),
        max(config.contexts) + bs,
        config.batch * (DECODE_PROMPT_TOKENS + DECODE_OUTPUT_TOKENS + bs),
        min(len(cases), max_seqs) * (max(config.needle_lengths) + config.needle_tokens + bs),
    )
    num_blocks = -(-need // bs) + max_seqs  # the same for every variant
    return _Inputs(texts, cases, style, decode_prompts, max_seqs, num_blocks)


def _press_numbers(llm: LLM) -> dict[str, Any] | None:
    """What the press removed and reclaimed, or None when no request was pressed."""
    st = llm.get_stats()
    if not st.num_pressed_requests:
        return None
    return {
        "pressed_requests": st.num_pressed_requests,
        "input_tokens": st.num_press_input_tokens,
        "removed_fraction": st.num_press_dropped_tokens / st.num_press_input_tokens,
        "reclaimed_blocks": st.num_reclaimed_blocks,
        "reclaimed_blocks_per_request": st.num_reclaimed_blocks / st.num_pressed_requests,
    }


def _measure(
    llm: LLM,
    config: EvalConfig,
    inp: _Inputs,
    tmp: Path,
    baseline: dict[str, Any] | None,
    base_greedy: list[list[int]] | None,
    tick: Callable[[str], None],
) -> tuple[dict[str, Any], list[list[int]]]:
    """One variant's results (without label and wall time) and its greedy tokens.

    ``baseline`` / ``base_greedy`` are the baseline's results and greedy tokens, None while
    measuring the baseline itself (which then saves its distributions into ``tmp``).
    """
    res: dict[str, Any] = _kv_numbers(llm, config.memory, inp.max_seqs, max(config.contexts))
    res["speed"] = sp = decode_throughput(llm, inp.decode_prompts, DECODE_OUTPUT_TOKENS)
    base_sp = baseline["speed"] if baseline is not None else sp
    sp["ratio_to_baseline"] = sp["output_tok_s"] / base_sp["output_tok_s"]
    sp["decode_ratio"] = sp["decode_tok_s"] / base_sp["decode_tok_s"]
    tick("speed")
    raw_texts = _quality(llm, inp.texts, tmp, baseline is None, tick)
    res["quality"] = rep.aggregate_quality(raw_texts)
    res["quality"]["by_context"] = {
        str(c): rep.aggregate_quality([r for r in raw_texts if r["context"] == c])
        for c in config.contexts
    }
    outs = llm.generate(
        prompt_token_ids=[t.token_ids[: t.context // 2] for t in inp.texts],
        sampling_params=greedy_params(config.greedy_tokens),
        use_tqdm=False,
    )
    greedy = [list(o.outputs[0].token_ids) for o in outs]
    for r, b, g in zip(raw_texts, base_greedy or greedy, greedy, strict=True):
        r.update(rep.greedy_agreement(b, g), greedy_token_ids=g)
    res["greedy"] = rep.greedy_summary(raw_texts, config.greedy_tokens)
    tick("greedy")
    raw_needle = run_needle(llm, inp.cases, config.needle_tokens, tick)
    res["needle"] = rep.needle_summary(raw_needle, config.needle_lengths, config.needle_depths)
    res["raw"] = {"texts": raw_texts, "needle": raw_needle}
    press = _press_numbers(llm)
    if press is not None:
        res["press"] = press
    return res, greedy


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Run the baseline and every variant; the JSON-ready report (:mod:`.report` formats it)."""
    from tqdm import tqdm

    from kvstack.engine.llm import LLM
    from kvstack.model.loader.registry import load_tokenizer, read_model_config

    t_start = time.perf_counter()
    model_config = read_model_config(config.model)
    config.validate(model_config.max_position_embeddings)
    inp = _inputs(config, load_tokenizer(config.model))
    variants = [codec_variant(BASELINE), *config.variants]
    total = len(variants) * (2 + len(inp.texts) + len(config.needle_lengths))
    bar = tqdm(total=total, desc="eval", unit="item", disable=not config.progress)
    results: list[dict[str, Any]] = []
    base_greedy: list[list[int]] | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="kvstack-eval-") as tmp:
            for var in variants:
                t_var = time.perf_counter()

                def tick(what: str, label: str = var.label) -> None:
                    bar.set_postfix_str(f"{label}: {what}", refresh=False)
                    bar.update(1)

                llm = LLM(
                    config.model,
                    dtype=config.dtype,
                    seed=config.seed,
                    block_size=config.block_size,
                    num_blocks=inp.num_blocks,
                    max_num_seqs=inp.max_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    prefix_cache="none",
                    **var.llm_kwargs,
                )
                baseline = results[0] if results else None
                res, greedy = _measure(llm, config, inp, Path(tmp), baseline, base_greedy, tick)
                base_greedy = base_greedy or greedy
                results.append({"label": var.label, "llm_kwargs": var.llm_kwargs, **res})
                results[-1]["wall_s"] = time.perf_counter() - t_var
                del llm  # one engine alive at a time
                gc.collect()
    finally:
        bar.close()
    corpus: dict[str, Any] = {"name": config.corpus, "kind": CORPUS_KINDS[config.corpus]}
    if config.corpus == "real":  # the manual's text is that of this Python
        corpus["python"] = platform.python_version()
    corpus["texts"] = [{"context": t.context, "index": t.index} for t in inp.texts]
    return {
        "version": 1,
        "tool": "kvstack eval",
        "config": config.to_json(),
        "model": rep.model_info(model_config),
        "baseline": BASELINE,
        "corpus": corpus,
        # Measured in this run: the baseline's accuracy on the needle cases, per length.
        "needle_task": {
            **NEEDLE_TASK,
            "style": inp.needle_style,
            "calibration": rep.needle_calibration(results[0]),
        },
        "kv_blocks_per_engine": inp.num_blocks,
        "machine": rep.machine_info(),
        "results": results,
        "wall_s": time.perf_counter() - t_start,
    }
