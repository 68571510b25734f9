"""The documents speak of the project: no work-log chronology, a short README, no dead links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Numbered work-log entries: "Session 12:", "session 4 measured", "sessions 16-18",
# "entry 7 of the work", "step 3 of the work". The history of the work lives in git.
CHRONOLOGY = re.compile(
    r"\bsessions? \d+(?:\s*-\s*\d+)?\b|\b(?:entry|step) \d+ of the work\b", re.IGNORECASE
)
README_MAX_LINES = 400

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The text of a document without its code blocks and code spans."""
    return CODE.sub("", FENCE.sub("", path.read_text()))


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = CODE.sub(lambda m: m.group(0)[1:-1], heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every anchor the headings of a document make, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_no_numbered_work_log_entries():
    found = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in CHRONOLOGY.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}")
    assert not found, "work-log chronology (history belongs to git):\n" + "\n".join(found)


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_relative_links_point_at_files_and_headings_that_exist():
    broken = []
    for path in DOCS:
        for target in LINK.findall(_prose(path)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
            elif ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{where} (outside the repository)")
    assert not broken, "broken links:\n" + "\n".join(broken)
