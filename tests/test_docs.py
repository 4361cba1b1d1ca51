"""The README is the guide and docs/ the reference (issue 24): every docs page is linked from the README,
and every relative link in the README, eval/README.md and docs/ leads to a file (and heading) that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of `path` (fenced code skipped)."""
    anchors, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked)):
            broken.append(target)
    return broken


def test_docs_has_pages_and_the_readme_links_every_one():
    readme = (ROOT / "README.md").read_text()
    assert DOCS, "docs/ holds the reference pages"
    assert [d.name for d in DOCS if f"(docs/{d.name}" not in readme] == []


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", ROOT / "eval" / "README.md", *DOCS]
    assert {str(p.relative_to(ROOT)): broken_links(p) for p in pages if broken_links(p)} == {}


def test_the_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[ok](#title) [gone](missing.md) [no heading](#nowhere)\n")
    assert broken_links(page) == ["missing.md", "#nowhere"]
