"""Grammar engines on the default model's vocabulary: compile time and mask time per token.

Why kvstack's structured outputs use llguidance: this measures it against xgrammar (vLLM's
default backend) on the same constraints and the same token sequences (a valid output,
tokenized; each step fills the mask for the current state, then accepts the next token).
Compile times are medians of ``--runs`` fresh compilations (xgrammar's cache off); mask
times are medians over every step of every run. xgrammar is optional: ``pip install
xgrammar`` into the venv that runs this (it is not a kvstack dependency; it pulls triton).
Writes ``benchmarks/results/grammar_backends.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from typing import Any

from bench_common import RESULTS_DIR, log, render_docs, write_json
from kvstack.model.loader.registry import load_tokenizer
from offline_throughput import machine_info

CUSTOMER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tier": {"enum": ["free", "pro", "enterprise"]},
    },
    "required": ["name", "age", "tier"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}}}},
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "items", "note"],
    "additionalProperties": False,
}  # fmt: skip
CASES: dict[str, tuple[str, Any, str]] = {
    "json customer": ("json", CUSTOMER, json.dumps({"name": "Ann Lee", "age": 41, "tier": "pro"})),
    "json order": ("json", ORDER, json.dumps({"id": "ABC-123456", "items": [
        {"sku": "x-1", "qty": 2}, {"sku": "y-22", "qty": 1}], "note": None})),
    "regex phone": ("regex", r"\+[0-9]{2} [0-9]{3} [0-9]{3} [0-9]{4}", "+41 123 456 7890"),
}  # fmt: skip


def llguidance_backend(tok: Any) -> tuple[Any, Any]:
    import llguidance
    import llguidance.torch

    llt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                 eos_token=sorted(tok.eos_token_ids))  # fmt: skip

    def compile_(kind: str, spec: Any) -> Any:
        g = (llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec)) if kind == "json"
             else llguidance.LLMatcher.grammar_from_regex(spec))  # fmt: skip
        return llguidance.LLMatcher(llt, g, log_level=0)

    mask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)

    def step(m: Any, token: int) -> bool:
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        return bool(m.consume_token(token))

    return compile_, step


def xgrammar_backend(tok: Any) -> tuple[Any, Any]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    eos = tok.backend.id_to_token(tok.eos_token_id)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=eos)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile_(kind: str, spec: Any) -> Any:
        g = (compiler.compile_json_schema(json.dumps(spec)) if kind == "json"
             else compiler.compile_regex(spec))  # fmt: skip
        return xgr.GrammarMatcher(g)

    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def step(m: Any, token: int) -> bool:
        m.fill_next_token_bitmask(mask, 0)
        return bool(m.accept_token(token))

    return compile_, step


def measure(name: str, make: Any, tok: Any, runs: int) -> dict[str, Any]:
    compile_, step = make(tok)
    out: dict[str, Any] = {}
    for case, (kind, spec, text) in CASES.items():
        ids = tok.encode(text, add_special_tokens=False)
        compiles, masks = [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            m = compile_(kind, spec)
            compiles.append(time.perf_counter() - t0)
            for token in ids:
                t0 = time.perf_counter()
                ok = step(m, token)
                masks.append(time.perf_counter() - t0)
                assert ok, f"{name} rejected a valid token of {case}"
        out[case] = {"compile_ms": 1e3 * statistics.median(compiles),
                     "mask_us": 1e6 * statistics.median(masks), "tokens": len(ids)}  # fmt: skip
        log(f"{name} {case}: compile {out[case]['compile_ms']:.2f} ms, "
            f"mask {out[case]['mask_us']:.1f} us/token")  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="compilations per case (default 5)")
    p.add_argument("--write-readme", action="store_true", help="then re-render the docs' tables")
    args = p.parse_args()
    tok = load_tokenizer("default")
    backends: dict[str, Any] = {"llguidance": llguidance_backend}
    try:
        import xgrammar  # noqa: F401

        backends["xgrammar"] = xgrammar_backend
    except ImportError:
        log("xgrammar is not installed here: measuring llguidance only (pip install xgrammar)")
    results = {name: measure(name, make, tok, args.runs) for name, make in backends.items()}
    doc = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": machine_info(), "vocab_size": tok.vocab_size, "runs": args.runs,
           "results": results}  # fmt: skip
    write_json(doc, RESULTS_DIR / "grammar_backends.json")
    m = doc["machine"]
    lines = [
        f"_{doc['date'][:10]}, {m.get('cpu_model')} ({m.get('cpu_count')} cores), commit "
        f"{m.get('git_commit')}, vocabulary {tok.vocab_size}, medians of {args.runs} runs_",
        "",
        "| constraint | "
        + " | ".join(f"{b} compile ms | {b} mask µs/token" for b in results)
        + " |",
        "|---|" + "---:|---:|" * len(results),
    ]
    for case in CASES:
        cells = [f"{results[b][case]['compile_ms']:.2f} | {results[b][case]['mask_us']:.1f}"
                 for b in results]  # fmt: skip
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
