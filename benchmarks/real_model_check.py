"""A real model in kvstack against transformers on the same GGUF, float32: the check
``tests/model/test_qwen_real.py`` runs for Qwen2.5-Coder-0.5B in the suite, for a model too
big for the suite (Qwen2.5-Coder-1.5B-Instruct by default: ~7 GB in float32).

For each chat prompt of ``kvstack.testing.real_models.CHATS`` (a coding question, a system
prompt, a tool-call request): transformers' greedy tokens and logits at every prompt
position (its own GGUF reader, dequantized, float32) against kvstack's (``--dtype float32
--quantization none``); and each chat template case (with and without tools, a finished
tool call) rendered by both. The reference runs first and is freed before kvstack loads, so
one float32 copy is in memory at a time. Prints the CPU model and ISA flags and a summary;
JSON to ``benchmarks/results/real_model_check-<model>-<date><tag>.json``; exits 1 when a
check fails (a greedy divergence where the reference's top-2 gap is at least
``TIE_GAP``, a logit further than ``--logit-atol``, a template that renders otherwise).

    PYTHONPATH=src python benchmarks/real_model_check.py [--model qwen2.5-coder-1.5b]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime

from bench_common import RESULTS_DIR, log, write_json
from kvstack.model.loader.registry import resolve_model_path
from kvstack.testing.real_models import (
    TIE_GAP,
    check_real_model,
    load_kvstack,
    load_reference,
    run_reference,
)
from offline_throughput import machine_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--logit-atol", type=float, default=2e-3)
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    args = ap.parse_args()
    info = machine_info()
    log(f"CPU: {info.get('cpu_model')} flags {' '.join(info.get('cpu_flags', []))}")
    path = resolve_model_path(args.model)
    start = time.perf_counter()
    hf, hf_tok = load_reference(path)
    loads = {"transformers_load": round(time.perf_counter() - start, 1)}
    log(f"transformers loaded {path.name} in {loads['transformers_load']} s")
    ref = run_reference(hf, hf_tok, args.new_tokens)
    del hf
    gc.collect()
    start = time.perf_counter()
    llm = load_kvstack(args.model)
    loads["kvstack_load"] = round(time.perf_counter() - start, 1)
    result = check_real_model(args.model, path, llm, ref, args.new_tokens)
    ok = result.ok(args.logit_atol)
    for i, p in enumerate(result.prompts):
        same = "identical" if p.first_difference is None else f"differ at {p.first_difference}"
        log(
            f"prompt {i} ({p.prompt_tokens} tokens): greedy {same}, max |logit diff| "
            f"{p.max_logit_diff:.1e}, argmax equal {p.argmax_equal}, ids equal {p.ids_equal}"
        )
    log(f"templates differing: {result.template_mismatches}; all checks {'hold' if ok else 'FAIL'}")
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    out = RESULTS_DIR / f"real_model_check-{args.model}-{date}{args.tag}.json"
    record = {
        "machine": info,
        "args": vars(args),
        "tie_gap": TIE_GAP,
        "ok": ok,
        "seconds": {**loads, **result.seconds},
        "result": asdict(result),
    }
    write_json(record, out)
    log(f"wrote {out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
