"""The docs are for users: short README, no process text, every package named in the layout, links that resolve.

Dates, loads, commits and issue numbers belong with measured figures in docs/benchmarks.md and with history in
CHANGELOG.md; anywhere else they make a doc read as a development log."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.paths import REPO

USER_DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "playbooks" / "README.md"])
PROCESS_ALLOWED = {REPO / "docs" / "benchmarks.md", REPO / "CHANGELOG.md"}
ALL_DOCS = [*USER_DOCS, REPO / "CHANGELOG.md"]

ISSUE = re.compile(r"\bissue #\d+|\bissues? #\d+", re.IGNORECASE)
# A bare commit hash: 7 to 40 hex digits with a letter and a digit, standing alone (a study name's suffix, a
# run folder or a path does not count).
HASH = re.compile(r"(?<![\w/.\-'])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/.\-'])")
STAMP = re.compile(r"\b20\d\d-\d\d-\d\d[ T]\d\d:\d\d\b|\b\d\d:\d\d(?:-\d\d:\d\d)? UTC\b")


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines < 300, f"README.md has {lines} lines; the detail belongs in docs/"


@pytest.mark.parametrize("doc", [d for d in USER_DOCS if d not in PROCESS_ALLOWED], ids=_name)
def test_no_process_text(doc):
    text = doc.read_text()
    found = [f"{pattern_name}: {m.group(0)!r} (line {text.count(chr(10), 0, m.start()) + 1})"
             for pattern_name, pattern in (("issue number", ISSUE), ("commit hash", HASH), ("time stamp", STAMP))
             for m in pattern.finditer(text)]
    assert not found, f"{_name(doc)}: " + "; ".join(found[:10])


def test_the_process_patterns_find_what_they_should():
    assert ISSUE.search("as issue #26 asks")
    assert HASH.search("until b586af3 it was") and HASH.search("(code of 9fbb20f)")
    assert not HASH.search("study 'odd_shapes-30aa4d60'") and not HASH.search("runs/20261205-075155-odd")
    assert not HASH.search("a 1024x1024 matmul, 0.0045 ms")
    assert STAMP.search("2026-12-05 06:30 UTC") and STAMP.search("(03:50-04:00 UTC, load 4)")


def _packages(root: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(REPO)) for p in root.rglob("__init__.py")
                  if "__pycache__" not in p.parts)


def test_layout_names_every_package():
    layout = (REPO / "docs" / "layout.md").read_text()
    missing = []
    for top in ("tpu_agent", "backend", "profilers"):
        for package in _packages(REPO / top):
            parts = Path(package).parts
            if len(parts) == 1:
                continue
            # a sub-package is named as `name/` in its parent's block, or by its path
            if f"{parts[-1]}/" not in layout and package not in layout:
                missing.append(package)
    assert not missing, f"docs/layout.md does not name: {missing}"


def _anchors(path: Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("doc", ALL_DOCS, ids=_name)
def test_relative_links_resolve(doc):
    broken = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
        link = m.group(1)
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{_name(doc)}: " + ", ".join(broken)


def test_layout_names_every_benchmark():
    layout = (REPO / "docs" / "layout.md").read_text()
    missing = [p.name for p in sorted((REPO / "benchmarks").glob("*.py")) if p.name not in layout]
    assert not missing, f"docs/layout.md does not name the benchmarks {missing}"
