"""The front door and the docs site keep their house rules: the README stays short, every
relative link of the README reaches a file of the repository, every page is in the site's
nav, and no page, benchmark or the README cites a tracker number or a path outside the
repository (say the reason instead; the vocabulary is defined on docs/design.md).

``mkdocs build --strict`` (``make lint``) checks the site's own links and anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TRACKER = re.compile(r"\b(issues?|stops?) #?\d+\b|#\d{2,}\b", re.IGNORECASE)
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\.md\b")


def _texts() -> list[Path]:
    """README, SECURITY.md, the docs pages and the benchmarks' sources and notes."""
    files = [
        README,
        REPO / "SECURITY.md",
        REPO / "mkdocs.yml",
        *sorted((REPO / "docs").rglob("*.md")),
    ]
    bench = REPO / "benchmarks"
    files += sorted(p for p in bench.rglob("*") if p.suffix in {".py", ".sh", ".md", ".jinja"})
    files += sorted((bench / "results").glob("*.json"))
    return files


def test_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert text.startswith("# kvstack\n\n```\nmake serve ")
    assert "\nmake test " in text.split("```")[1]
    for heading in ("## Features", "## Performance", "## Read on"):
        assert heading in text


def test_readme_links_reach_files_of_the_repository() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


@pytest.mark.parametrize("pattern", [TRACKER, OUTSIDE], ids=["tracker numbers", "outside paths"])
def test_no_tracker_numbers_or_outside_paths(pattern: re.Pattern[str]) -> None:
    hits = []
    for path in _texts():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = pattern.search(line)
            if m and "design.md" not in m.group(0):
                hits.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)}")
    assert not hits, "\n".join(hits[:20])


def test_every_result_file_a_page_cites_is_committed() -> None:
    dated = re.compile(r"[a-z_]+(?:-[a-z0-9.]+)*-\d{4}-?\d{2}-?\d{2}[a-z0-9.-]*\.(?:json|png)")
    in_folder = re.compile(r"benchmarks/results/([a-z][\w.-]+\.(?:json|png))")
    missing = set()
    for page in [README, *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text()
        names = set(dated.findall(text)) | set(in_folder.findall(text))
        missing |= {
            f"{page.name}: {n}" for n in names if not (REPO / "benchmarks/results" / n).exists()
        }
    assert not missing, sorted(missing)


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert pages
    missing = [p for p in pages if f": {p}" not in nav]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
