"""The repository speaks only its own vocabulary: no tracker numbers, no era numbers in
code, no path outside the repository.

A reader of the code, the tests, the benchmarks or the docs has neither the tracker nor the
maintainers' notes, so a comment that says why by pointing at a tracker entry says nothing
to them: each reference states its reason or concept instead (segment reuse, KV tiers, a
slowloris client...). The eras of KV-cache management (a contiguous slab, paged blocks,
prefix reuse, tiers, compression) are defined in ``docs/design.md``; code and tests name
the technique itself, and a docs page that says "era N" links that page. Result files in
``benchmarks/results/`` are data as measured and are not read.

Nothing is imported; files are read as text (undecodable files are skipped).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A tracker entry by number (also plural, or with "#"), a session's stop number, and paths
# into the maintainers' shared folder or design notes, which live outside the repository.
TRACKER = (
    re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    re.compile(r"\bstop \d+\b", re.IGNORECASE),
    re.compile(r"\bshared(?=/)|\bDESIGN\.md\b"),
)
# An era by number, spelled with a space, a hyphen or nothing between ("eras" too).
ERA = re.compile(r"\beras? ?-?\d", re.IGNORECASE)
# The page that defines the eras; docs pages that say "era N" link it.
ERA_PAGE = "design.md"

CODE_DIRS = ("src", "tests", "benchmarks", "scripts", "deploy")
CODE_FILES = ("SECURITY.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = {
    *(".py", ".pyi", ".cpp", ".h", ".md", ".sh", ".toml", ".yaml", ".yml", ".json"),
    *(".js", ".html", ".css", ".txt", ".cfg", ".ini", ""),
}
SKIPPED = (ROOT / "benchmarks" / "results",)


def text_files(*roots: Path) -> list[Path]:
    """Every text file under ``roots`` (a root may be a file), results, caches and build
    metadata (``*.egg-info``, a copy of an old README) aside."""
    files: list[Path] = []
    for root in roots:
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in paths:
            if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
                continue
            if any(path.is_relative_to(s) for s in SKIPPED) or any(
                part == "__pycache__" or part.endswith(".egg-info") for part in path.parts
            ):
                continue
            files.append(path)
    return files


def hits(files: list[Path], patterns: tuple[re.Pattern[str], ...]) -> list[str]:
    """``path:line: text`` of every line a pattern matches."""
    found: list[str] = []
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for no, line in enumerate(lines, 1):
            if any(p.search(line) for p in patterns):
                found.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()[:120]}")
    return found


def code_files() -> list[Path]:
    return text_files(*(ROOT / d for d in CODE_DIRS), *(ROOT / f for f in CODE_FILES))


def docs_files() -> list[Path]:
    return text_files(ROOT / "docs", ROOT / "README.md")


def test_code_names_reasons_not_tracker_entries_or_eras() -> None:
    """src/, tests/, benchmarks/, scripts/, deploy/ and the top-level files: no tracker
    number, no era number, no path outside the repository."""
    found = hits(code_files(), (*TRACKER, ERA))
    assert not found, f"{len(found)} references to replace by their reason:\n" + "\n".join(found)


def test_docs_name_reasons_and_link_the_page_that_defines_eras() -> None:
    """docs/ and README.md: no tracker number and no path outside the repository; a page
    that says "era N" is the page that defines the eras or links it."""
    files = docs_files()
    found = hits(files, TRACKER)
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if ERA.search(text) and path.name != ERA_PAGE and ERA_PAGE not in text:
            found += [f"{h} (without a link to {ERA_PAGE})" for h in hits([path], (ERA,))]
    assert not found, f"{len(found)} references to replace by their reason:\n" + "\n".join(found)


def test_patterns_catch_what_they_are_for(tmp_path: Path) -> None:
    """The patterns flag each form of reference (written here at run time, so this file's
    own text stays clean) and leave ordinary prose alone."""
    bad = [
        f"# issue {18}'s repair rows",
        f"(Issue #{20}, finding 5)",
        f"issues {15}/16",
        f"a session's stop {53}",
        f"presses (era {5}) compress",
        f"Era {4}: counters per tier",
        f"the era-{1} baselines",
        f'"era{3}-radix"',
        f"see ../{'shared'}/notes.md",
        f"the facts {'DESIGN'}.md quotes",
    ]
    good = [
        "a stop string ends the output",
        "the issue tracker",
        "docs/design.md defines the eras",
        "operator: a generation of KV techniques",
        "round 2 of a multi-turn workload",
        "a shared prefix's blocks",
    ]
    bad_file, good_file = tmp_path / "bad.py", tmp_path / "good.py"
    bad_file.write_text("\n".join(bad) + "\n")
    good_file.write_text("\n".join(good) + "\n")
    patterns = (*TRACKER, ERA)
    missed = [line for line in bad if not any(p.search(line) for p in patterns)]
    flagged = [line for line in good if any(p.search(line) for p in patterns)]
    assert not missed and not flagged, (missed, flagged)
    assert text_files(tmp_path) == [bad_file, good_file]
