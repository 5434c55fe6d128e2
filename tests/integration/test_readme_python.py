"""The Python examples of the README and of docs/python_api.md run as written on the embedded model.

docs/python_api.md: the ```python blocks of its "Use it from Python" section (decode, collect,
evaluate, recipes, serving export). README.md: every ```python block (the first screen's short
decode example). Each document's blocks run in order, in one shared namespace, in a fresh folder
(they write runs/ and serve/ relative to the working directory).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.embedded

ROOT = Path(__file__).resolve().parents[2]
SECTION = "Use it from Python"
_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks(markdown: str, section: str = SECTION) -> list[str]:
    """The ```python code blocks inside the ``## {section}`` heading, up to the next heading of
    the same or a higher level (lines inside code fences, such as ``# comments``, are no headings)."""
    lines = markdown.splitlines(keepends=True)
    in_fence, start, level, end = False, None, 0, len(lines)
    for i, line in enumerate(lines):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        heading = None if in_fence else re.match(r"^(#{1,6}) (.*?)\s*$", line)
        if heading is None:
            continue
        if start is None and heading.group(2) == section:
            start, level = i + 1, len(heading.group(1))
        elif start is not None and len(heading.group(1)) <= level:
            end = i
            break
    if start is None:
        return []
    return _BLOCK.findall("".join(lines[start:end]))


def test_block_extraction_stops_at_the_next_section():
    md = "# x\n## Use it from Python\n```python\na = 1\n```\ntext\n```bash\nls\n```\n## Other\n```python\nb = 2\n```\n"
    assert python_blocks(md) == ["a = 1\n"]
    assert python_blocks("# nothing here\n") == []
    md = "## Use it from Python\n```python\n# a comment, not a heading\nx = 1\n```\n### Sub\n```python\ny = 2\n```\n# Next\n"
    assert python_blocks(md) == ["# a comment, not a heading\nx = 1\n", "y = 2\n"]


@dataclass(frozen=True)
class Document:
    """One document's Python examples and what running them must show."""

    name: str
    blocks: list[str]
    min_blocks: int  # the examples the document promises
    needed_calls: tuple[str, ...]  # API calls its examples must show
    needed_output: tuple[str, ...]  # text the examples must print
    needed_files: tuple[str, ...] = ()  # files (relative to the working folder) they must write


def _documents() -> list[Document]:
    api = (ROOT / "docs" / "python_api.md").read_text()
    readme = (ROOT / "README.md").read_text()
    return [
        Document("docs/python_api.md", python_blocks(api), 3,
                 ("CompressedCache.from_recipe", "generate(", "kvcalib.collect(", "kvcalib.evaluate("),
                 ("bits per K/V element", "full precision"), ("runs/smol/stats.safetensors",)),
        # the README's example decodes "The capital of France is" and prints the prompt with its continuation
        Document("README.md", _BLOCK.findall(readme), 1, ("CompressedCache.from_recipe", "generate("),
                 ("The capital of France is",)),
    ]


def test_every_document_has_its_examples():
    for doc in _documents():
        assert len(doc.blocks) >= doc.min_blocks, f"{doc.name}: {len(doc.blocks)} python blocks, expected >= {doc.min_blocks}"
        joined = "\n".join(doc.blocks)
        for needed in doc.needed_calls:
            assert needed in joined, f"{doc.name} lacks an example of {needed}"


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: d.name)
def test_python_examples_run(doc, tmp_path, monkeypatch, capsys):
    assert len(doc.blocks) >= doc.min_blocks, f"{doc.name}: too few python blocks"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    t0 = time.perf_counter()
    for i, code in enumerate(doc.blocks):
        try:
            exec(compile(code, f"{doc.name}[python block {i + 1}]", "exec"), namespace)
        except Exception as err:  # name the block that failed
            raise AssertionError(f"{doc.name}: python block {i + 1} failed: {type(err).__name__}: {err}\n{code}") from err
    wall = time.perf_counter() - t0
    out = capsys.readouterr().out
    for text in doc.needed_output:
        assert text in out, f"{doc.name}: the examples did not print {text!r}"
    for rel in doc.needed_files:
        assert (tmp_path / rel).is_file(), f"{doc.name}: the examples did not write {rel}"
    # ~45 s on 2 idle CPU cores for docs/python_api.md; the guard is loose because shared machines run slower
    assert wall < 180, f"{doc.name}: the examples took {wall:.0f} s; keep them small"
