"""Every relative link in README.md and docs/*.md points at a file that exists, and every
``#anchor`` at a heading of its target page (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_EXTERNAL = ("http://", "https://", "mailto:")


def _prose_lines(markdown: str) -> list[str]:
    """The lines outside fenced code blocks (links inside fences are code, not links)."""
    lines, in_fence = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            lines.append(line)
    return lines


def links(markdown: str) -> list[str]:
    """Link targets in ``markdown``, outside code fences; a link whose text is a code span still
    counts (``[`x.md`](x.md)``), a link written inside a code span does not."""
    out = []
    for line in _prose_lines(markdown):
        # blank out code spans that are not a link's text: "[`a`](b)" keeps its link
        masked = _CODE_SPAN.sub(lambda m: m.group(0) if _inside_link_text(line, m.start()) else " " * len(m.group(0)), line)
        out.extend(m.group(1) for m in _LINK.finditer(masked))
    return out


def _inside_link_text(line: str, pos: int) -> bool:
    """True when ``pos`` follows an unclosed ``[`` on its line (the code span is a link's text)."""
    before = line[:pos]
    return before.rfind("[") > before.rfind("]")


def heading_ids(markdown: str) -> set[str]:
    """GitHub's ids of the headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces as
    ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    ids: set[str] = set()
    for line in _prose_lines(markdown):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in ids:
            slug, n = f"{base}-{n}", n + 1
        ids.add(slug)
    return ids


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """``target: why`` for each relative link of ``page`` that does not resolve inside ``root``."""
    problems = []
    for target in links(page.read_text()):
        if target.startswith(_EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        if not dest.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(root)}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_ids(dest.read_text()):
            problems.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_link_and_heading_parsing():
    md = ("See [a](docs/a.md), [`b`](b.json#x), ![plot](p.png), [web](https://x.org) and "
          "`[not](code.md)`.\n```\n[fenced](f.md)\n```\n# Search vs presets: the curve (held-out)\n"
          "## `kvcalib collect`: what it records\n## Notes\n## Notes\n")
    assert links(md) == ["docs/a.md", "b.json#x", "p.png", "https://x.org"]
    assert heading_ids(md) == {"search-vs-presets-the-curve-held-out", "kvcalib-collect-what-it-records",
                               "notes", "notes-1"}


def test_a_missing_file_a_missing_heading_and_an_outside_path_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("# Title\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/x.md#title) [gone](docs/y.md) [anchor](docs/x.md#nope) [self](#here) "
                    "[bad self](#there) [up](../DESIGN.md)\n## Here\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ")[0] for p in problems] == ["docs/y.md", "docs/x.md#nope", "#there", "../DESIGN.md"]


def test_docs_exist():
    names = {p.name for p in _pages()}
    assert {"README.md", "design.md", "results.md", "gpu.md", "python_api.md", "commands.md"} <= names


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    problems = broken_links(page)
    assert not problems, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(problems)
