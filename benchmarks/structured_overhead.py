"""What structured outputs cost: output tok/s of a constrained batch against a plain one.

Same prompts, same number of output tokens (a constraint that cannot finish before
``--max-tokens``, and ``ignore_eos`` for the plain run), batch 32 by default, bf16, the
default model. Plain and constrained runs alternate (``--runs`` pairs) and the ratio of
the medians is reported, with the CPU it ran on. Constraints measured:

    json-string   {"story": <a string of 2000+ chars>}   the mask walks string states
    json-fields   an object of 24 typed fields            enums, integers, keys
    regex         ([a-z]+ [0-9]+, )*                      a regex automaton

Writes ``benchmarks/results/structured_overhead.json``; ``--write-readme`` then
re-renders the docs' measured tables from the results (``benchmarks/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from typing import Any

from bench_common import RESULTS_DIR, log, median, render_docs, write_json
from kvstack import LLM, SamplingParams
from kvstack.core.structured_outputs import StructuredOutputsParams as SO
from offline_throughput import machine_info

FIELDS = {
    f"field_{i}": (
        {"type": "integer", "minimum": 0, "maximum": 10_000}
        if i % 3 == 0
        else {"enum": ["alpha", "beta", "gamma", "delta"]}
        if i % 3 == 1
        else {"type": "string", "maxLength": 200}
    )
    for i in range(24)
}
CONSTRAINTS = {
    "json-string": SO(json={"type": "object", "required": ["story"],
                            "properties": {"story": {"type": "string", "minLength": 2000}}}),
    "json-fields": SO(json={"type": "object", "properties": FIELDS, "required": list(FIELDS)}),
    "regex": SO(regex=r"([a-z]+ [0-9]+, ){200,}"),
}  # fmt: skip


def run(llm: LLM, prompts: list[list[dict[str, str]]], sp: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.chat(prompts, sp)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="requests per run (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens each (default 64)")
    p.add_argument("--runs", type=int, default=3, help="plain/constrained pairs (default 3)")
    p.add_argument("--only", choices=list(CONSTRAINTS), action="append", help="constraint(s)")
    p.add_argument("--write-readme", action="store_true", help="then re-render the docs' tables")
    args = p.parse_args()
    llm = LLM("default", max_num_seqs=args.batch)
    prompts = [[{"role": "user", "content": f"Tell story number {i} as JSON."}]
               for i in range(args.batch)]  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    run(llm, prompts[:4], plain)  # warm up (kernels, allocator)
    rows: list[dict[str, Any]] = []
    for name in args.only or list(CONSTRAINTS):
        so = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            structured_outputs=CONSTRAINTS[name])  # fmt: skip
        run(llm, prompts[:4], so)  # compile + warm up
        base, con = [], []
        for i in range(args.runs):
            dt, n = run(llm, prompts, plain)
            base.append(n / dt)
            dt, n_so = run(llm, prompts, so)
            con.append(n_so / dt)
            log(f"{name} pair {i + 1}: plain {base[-1]:.0f} tok/s ({n} tok), "
                f"constrained {con[-1]:.0f} tok/s ({n_so} tok)")  # fmt: skip
        rows.append({"constraint": name, "plain_tok_s": base, "constrained_tok_s": con,
                     "ratio": median(con) / median(base)})  # fmt: skip
    doc = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
           "machine": machine_info(), "batch": args.batch, "max_tokens": args.max_tokens,
           "runs": args.runs, "rows": rows}  # fmt: skip
    write_json(doc, RESULTS_DIR / "structured_overhead.json")
    m = doc["machine"]
    table = [
        f"_{doc['date'][:10]}, {m.get('cpu_model')} ({m.get('cpu_count')} cores; "
        f"{', '.join(m.get('cpu_flags', []))}), commit {m.get('git_commit')}, bf16, batch "
        f"{args.batch} × {args.max_tokens} tokens, medians of {args.runs} alternating pairs_",
        "",
        "| constraint | plain out tok/s | constrained out tok/s | constrained / plain |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        table.append(f"| {r['constraint']} | {median(r['plain_tok_s']):.0f} | "
                     f"{median(r['constrained_tok_s']):.0f} | {r['ratio']:.2f}× |")  # fmt: skip
    print("\n".join(table))
    print(json.dumps({r["constraint"]: round(r["ratio"], 3) for r in rows}))
    if args.write_readme:
        render_docs()


if __name__ == "__main__":
    main()
