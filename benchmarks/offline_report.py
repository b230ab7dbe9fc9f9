"""The report of ``offline_throughput.py``: result-file entry keys, greedy-token agreement
with transformers, and the markdown table (the docs' tables are rendered by
``benchmarks/docs_tables.py``).
"""

from __future__ import annotations

from typing import Any

from bench_common import render_docs

PEER_NAMES = ("transformers", "vllm", "kvstack")


def entry_key(entry: dict[str, Any]) -> tuple[str, int, int, str, bool]:
    """Identity of a result entry in the file: engine, case, dtype, prefix caching."""
    dtype = entry.get("dtype") or entry.get("config", {}).get("dtype", "bfloat16")
    prefix = bool(entry.get("config", {}).get("prefix_caching", False))
    return entry["peer"], entry["num_prompts"], entry["max_new_tokens"], dtype, prefix


def agreement(results: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Per engine: how many leading greedy tokens of each sample prompt match transformers'."""
    ref = next((r for r in results if r.get("peer") == "transformers" and "error" not in r), None)
    if ref is None:
        return {}
    out: dict[str, list[int]] = {}
    for r in results:
        if r is ref or "error" in r:
            continue
        common = []
        for a, b in zip(ref["sample_output_ids"], r["sample_output_ids"], strict=False):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            common.append(n)
        out[r["peer"]] = common
    return out


def annotate_agreement(entries: list[dict[str, Any]]) -> None:
    """Set ``agreement_with_transformers`` on every entry that has a transformers entry for
    the same case and dtype (from this run or an earlier one in the same file)."""
    for case in sorted({entry_key(e)[1:4] for e in entries}):
        same_case = [e for e in entries if entry_key(e)[1:4] == case]
        for peer, common in agreement(same_case).items():
            for e in same_case:
                if e["peer"] == peer:
                    e["agreement_with_transformers"] = common


def markdown_table(entries: list[dict[str, Any]]) -> str:
    """Markdown table of result entries (ordered by case, then engine)."""
    order = {name: i for i, name in enumerate(PEER_NAMES)}
    rows = sorted(
        entries,
        key=lambda e: (
            e["num_prompts"],
            e["max_new_tokens"],
            entry_key(e)[3],
            entry_key(e)[4],
            order.get(e["peer"], 99),
        ),
    )
    lines = [
        "| engine | prompts × new tokens | dtype | prefix caching | output tok/s "
        "| × vllm (paired) | processed tok/s | 1-request decode tok/s | wall s (median) | runs "
        "| others' load |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in rows:
        case = f"{e['num_prompts']} × {e['max_new_tokens']}"
        prefix = "yes" if entry_key(e)[4] else "no"
        if "error" in e:
            lines.append(
                f"| {e['peer']} | {case} | {entry_key(e)[3]} | {prefix} | failed: {e['error']} "
                "| | | | | | |"
            )
            continue
        single = e.get("single", {}).get("decode_tok_s", "–")
        load = max(e.get("other_load_cores") or [float("nan")])
        ratio = e.get("paired_ratio_vs_vllm")
        ratio_s = (
            f"{ratio:.2f}× ({', '.join(f'{r:.2f}' for r in e['paired_ratios_vs_vllm'])})"
            if ratio
            else "–"
        )
        lines.append(
            f"| {e['peer']} {e.get('engine_version', '')} | {case} | {e['config']['dtype']} "
            f"| {prefix} | {e['output_tok_s']:.0f} | {ratio_s} | {e['processed_tok_s']:.0f} "
            f"| {single} "
            f"| {e['wall_s_median']:.2f} | {e['runs_done']} | {load:.2f} |"
        )
    return "\n".join(lines)


def report(doc: dict[str, Any], readme: bool) -> None:
    """Print the table and the greedy-token agreement; re-render the docs' tables if asked."""
    print(markdown_table(doc["entries"]))
    for e in doc["entries"]:
        if "agreement_with_transformers" in e:
            print(
                f"\n{e['peer']} {e['num_prompts']}x{e['max_new_tokens']} {entry_key(e)[3]}: "
                f"leading greedy tokens equal to transformers' for the sample prompts: "
                f"{e['agreement_with_transformers']} of {e['max_new_tokens']}"
            )
    if readme:
        render_docs()
