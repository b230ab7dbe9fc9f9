"""``kvstack eval``: what a KV codec or press costs in quality, memory and speed.

Every variant (a ``--kv-cache-dtype`` codec, or a ``--kv-press`` at one ratio) runs the
model on the same
inputs as the baseline (``auto``: the KV cache in the model's ``--dtype``), each with a
fresh :class:`~kvstack.llm.LLM` (one engine alive at a time), and is compared on:

(a) teacher-forced quality: ``LLM.score`` of every corpus text from its middle on (prompt
    run in chunks of 512 tokens, so later chunks read earlier chunks' KV back through the
    codec): mean KL(baseline || variant) per token in nats, top-1 agreement, perplexities;
(b) greedy agreement: ``--greedy-tokens`` greedy tokens after each text's first half;
    share of positions with the baseline's token, mean length of the identical prefix;
(c) needle (passkey) retrieval accuracy (``eval_tasks``: what works for the 135M model);
(d) memory and speed: KV bytes per token, tokens that fit in ``--memory`` (and the ratio
    to a bf16 cache), and ``--batch`` requests of a 512-token prompt generating 64 tokens:
    output tokens / wall time of ``generate`` (the ratio to the baseline), and the decode
    phase alone (tokens after the last prompt chunk / time after it).

The corpus is seeded synthetic prose (TextMaker, see ``eval_tasks``), or text the model
wrote itself (``--corpus generated``). Every variant gets
the same number of KV blocks, so scheduling (and with it the numerics of batched steps)
is identical and differences come from the codec alone. The baseline's log-distributions
wait in a temporary directory: at most two ``[n, vocab]`` matrices are in memory. A
variant is a label plus ``LLM`` keyword arguments, so other KV compression methods can be
compared the same way. The command line is ``tools/eval_cli.py``.
"""

from __future__ import annotations

import gc
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstack.errors import ConfigError

if TYPE_CHECKING:
    from kvstack.llm import LLM
from kvstack.tools import eval_report as rep
from kvstack.tools.eval_tasks import (
    DECODE_OUTPUT_TOKENS,
    DECODE_PROMPT_TOKENS,
    NEEDLE_TASK,
    EvalText,
    decode_throughput,
    generated_corpus,
    greedy_params,
    make_corpus,
    make_text_ids,
    needle_cases,
    run_needle,
)

DEFAULT_CODECS = ("fp8", "int8", "int4", "kivi2", "rotated4")
BASELINE = "auto"
CORPUS_KIND = "TextMaker synthetic prose, seeded"
# option -> (full default, --quick default)
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "contexts": ([1024, 2048, 4096], [1024, 4096]),
    "num_texts": (2, 1),
    "greedy_tokens": (64, 32),
    "needle_lengths": ([1024, 2048, 4096], [2048]),
    "needle_depths": ([0.1, 0.5, 0.9], [0.1, 0.5, 0.9]),
    "needle_trials": (3, 2),
    "batch": (8, 4),
}


@dataclass(frozen=True)
class Variant:
    """What is compared against the baseline: a label and extra ``LLM`` keyword arguments."""

    label: str
    llm_kwargs: dict[str, Any]


def codec_variant(name: str) -> Variant:
    return Variant(name, {"kv_cache_dtype": name})


def press_variant(name: str, ratio: float) -> Variant:
    """A press removing ``ratio`` of each prompt's KV (applied after the first half of a
    scored text, after a greedy prompt, and before a needle prompt's question)."""
    return Variant(f"{name}@{ratio:g}", {"kv_press": name, "kv_press_ratio": ratio})


@dataclass
class EvalConfig:
    """Everything ``run_eval`` needs; ``validate`` raises ``ConfigError`` on bad values."""

    variants: list[Variant] = field(
        default_factory=lambda: list(map(codec_variant, DEFAULT_CODECS))
    )
    model: str = "default"
    dtype: str = "bfloat16"
    contexts: list[int] = field(default_factory=lambda: list(DEFAULTS["contexts"][0]))
    num_texts: int = DEFAULTS["num_texts"][0]
    greedy_tokens: int = DEFAULTS["greedy_tokens"][0]
    needle_lengths: list[int] = field(default_factory=lambda: list(DEFAULTS["needle_lengths"][0]))
    needle_depths: list[float] = field(default_factory=lambda: list(DEFAULTS["needle_depths"][0]))
    needle_trials: int = DEFAULTS["needle_trials"][0]
    needle_tokens: int = 12
    memory: int = 1 << 30
    batch: int = DEFAULTS["batch"][0]
    seed: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 512
    quick: bool = False
    progress: bool = True
    corpus: str = "prose"  # "prose" (TextMaker, ppl ~50) or "generated" (the model's own)

    def validate(self, max_model_len: int | None = None) -> None:
        from kvstack.kv.codecs import codec_class

        if not self.variants:
            raise ConfigError("nothing to evaluate: the --kv-cache-dtype list is empty")
        from kvstack.kv.press import check_press

        for v in self.variants:
            codec_class(str(v.llm_kwargs.get("kv_cache_dtype", BASELINE)))
            try:
                check_press(v.llm_kwargs.get("kv_press"), v.llm_kwargs.get("kv_press_ratio", 0.0))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.corpus not in ("prose", "generated"):
            raise ConfigError(f"--corpus must be prose or generated, got {self.corpus!r}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"--dtype must be bfloat16 or float32, got {self.dtype!r}")
        for name, n in (
            ("--num-texts", self.num_texts),
            ("--greedy-tokens", self.greedy_tokens),
            ("--needle-trials", self.needle_trials),
            ("--needle-tokens", self.needle_tokens),
            ("--batch", self.batch),
            ("--memory", self.memory),
        ):
            if n <= 0:
                raise ConfigError(f"{name} must be positive, got {n}")
        for name, lengths, extra in (
            ("--contexts", self.contexts, self.greedy_tokens),
            ("--needle-lengths", self.needle_lengths, self.needle_tokens),
        ):
            if not lengths:
                raise ConfigError(f"{name} is empty")
            if min(lengths) < 64:
                raise ConfigError(f"{name} must be at least 64 tokens, got {min(lengths)}")
            if max_model_len is not None and max(lengths) + extra > max_model_len:
                raise ConfigError(
                    f"{name} {max(lengths)} plus {extra} generated tokens is longer than "
                    f"the model's context ({max_model_len} tokens)"
                )
        if not self.needle_depths or any(not 0.0 <= d <= 1.0 for d in self.needle_depths):
            raise ConfigError(f"--needle-depths must be in [0, 1], got {self.needle_depths}")

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["variants"] = [asdict(v) for v in self.variants]
        return d


# ---------------------------------------------------------------------------- runner


def _kv_numbers(llm: LLM, memory: int, max_seqs: int) -> dict[str, Any]:
    import torch

    from kvstack.kv.storage import KVStorage

    eng = llm.engine
    mc, bs, codec = eng.model_config, eng.config.cache.block_size, eng.config.cache.kv_cache_dtype
    blocks = KVStorage.num_blocks_for_memory(mc, bs, eng.dtype, memory, codec, max_seqs)
    bf16 = KVStorage.num_blocks_for_memory(mc, bs, torch.bfloat16, memory, "auto", max_seqs)
    return {
        "bytes_per_token": eng.kv_bytes_per_token,
        "tokens_in_memory": blocks * bs,
        "capacity_ratio": blocks / bf16,
    }


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


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Run the baseline and every variant; the JSON-ready report (``eval_report`` formats it)."""
    from kvstack.llm import LLM
    from kvstack.model.registry import load_tokenizer

    t_start = time.perf_counter()
    model_config = _model_config(config.model)
    config.validate(model_config.max_position_embeddings)
    tok = load_tokenizer(config.model)
    if config.corpus == "generated":
        gen = LLM(config.model, dtype=config.dtype, seed=config.seed, prefix_cache="none")
        texts = generated_corpus(gen, config.contexts, config.num_texts, config.seed)
        del gen
        gc.collect()
    else:
        texts = make_corpus(tok, config.contexts, config.num_texts, config.seed)
    cases = needle_cases(
        tok, config.needle_lengths, config.needle_depths, config.needle_trials, config.seed
    )
    rng = random.Random(f"kvstack-eval-decode-{config.seed}")
    decode_prompts = [make_text_ids(tok, DECODE_PROMPT_TOKENS, rng) for _ in range(config.batch)]
    variants = [codec_variant(BASELINE), *config.variants]
    bs, max_seqs = config.block_size, max(config.batch, 8)
    need = max(
        sum(t.context // 2 + config.greedy_tokens + bs for t in texts),
        max(config.contexts) + bs,
        config.batch * (DECODE_PROMPT_TOKENS + DECODE_OUTPUT_TOKENS + bs),
        min(len(cases), max_seqs) * (max(config.needle_lengths) + config.needle_tokens + bs),
    )
    num_blocks = -(-need // bs) + max_seqs  # the same for every variant
    from tqdm import tqdm

    total = len(variants) * (2 + len(texts) + len(config.needle_lengths))
    bar = tqdm(total=total, desc="eval", unit="item", disable=not config.progress)
    results: list[dict[str, Any]] = []
    base_greedy: list[list[int]] = []
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
                    block_size=bs,
                    num_blocks=num_blocks,
                    max_num_seqs=max_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    prefix_cache="none",
                    **var.llm_kwargs,
                )
                res: dict[str, Any] = {"label": var.label, "llm_kwargs": var.llm_kwargs}
                res.update(_kv_numbers(llm, config.memory, max_seqs))
                res["speed"] = sp = decode_throughput(llm, decode_prompts, DECODE_OUTPUT_TOKENS)
                base_sp = results[0]["speed"] if results else sp
                sp["ratio_to_baseline"] = sp["output_tok_s"] / base_sp["output_tok_s"]
                sp["decode_ratio"] = sp["decode_tok_s"] / base_sp["decode_tok_s"]
                tick("speed")
                raw_texts = _quality(llm, texts, Path(tmp), not results, tick)
                res["quality"] = rep.aggregate_quality(raw_texts)
                res["quality"]["by_context"] = {
                    str(c): rep.aggregate_quality([r for r in raw_texts if r["context"] == c])
                    for c in config.contexts
                }
                outs = llm.generate(
                    prompt_token_ids=[t.token_ids[: t.context // 2] for t in texts],
                    sampling_params=greedy_params(config.greedy_tokens),
                )
                greedy = [list(o.outputs[0].token_ids) for o in outs]
                base_greedy = base_greedy or greedy
                for r, b, g in zip(raw_texts, base_greedy, greedy, strict=True):
                    r.update(rep.greedy_agreement(b, g), greedy_token_ids=g)
                res["greedy"] = rep.greedy_summary(raw_texts, config.greedy_tokens)
                tick("greedy")
                raw_needle = run_needle(llm, cases, config.needle_tokens, tick)
                res["needle"] = rep.needle_summary(
                    raw_needle, config.needle_lengths, config.needle_depths
                )
                res["raw"] = {"texts": raw_texts, "needle": raw_needle}
                st = llm.get_stats()
                if st.num_pressed_requests:
                    res["press"] = {
                        "pressed_requests": st.num_pressed_requests,
                        "input_tokens": st.num_press_input_tokens,
                        "removed_fraction": st.num_press_dropped_tokens / st.num_press_input_tokens,
                        "reclaimed_blocks": st.num_reclaimed_blocks,
                        "reclaimed_blocks_per_request": st.num_reclaimed_blocks
                        / st.num_pressed_requests,
                    }
                res["wall_s"] = time.perf_counter() - t_var
                results.append(res)
                del llm, outs
                gc.collect()
    finally:
        bar.close()
    return {
        "version": 1,
        "tool": "kvstack eval",
        "config": config.to_json(),
        "model": rep.model_info(model_config),
        "baseline": BASELINE,
        "corpus": {
            "kind": CORPUS_KIND if config.corpus == "prose" else "generated by the model",
            "texts": [{"context": t.context, "index": t.index} for t in texts],
        },
        "needle_task": NEEDLE_TASK,
        "kv_blocks_per_engine": num_blocks,
        "machine": rep.machine_info(),
        "results": results,
        "wall_s": time.perf_counter() - t_start,
    }


def _model_config(model: str) -> Any:
    """The model's architecture from its config alone (no weights loaded)."""
    from kvstack.model.gguf import read_gguf_config
    from kvstack.model.registry import model_format, resolve_model_path
    from kvstack.model.safetensors import config_from_hf, read_hf_config

    path = resolve_model_path(model)
    if model_format(path) == "gguf":
        return read_gguf_config(path)
    return config_from_hf(read_hf_config(path), path)
