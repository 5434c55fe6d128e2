"""The README's "Use it from Python" examples run as written on the embedded model.

The ```python blocks of docs/python_api.md (the section's source) and, where README.md has the
section, of README.md are executed in order, one shared namespace per document, in a fresh
folder (they write runs/ and serve/ relative to the working directory).
"""

from __future__ import annotations

import re
import time
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


def _documents() -> list[tuple[str, list[str]]]:
    docs = [("docs/python_api.md", python_blocks((ROOT / "docs" / "python_api.md").read_text()))]
    readme = ROOT / "README.md"
    if readme.is_file():
        blocks = python_blocks(readme.read_text())
        if blocks and blocks != docs[0][1]:  # the README pastes this section: run it once if identical
            docs.append(("README.md", blocks))
    return docs


@pytest.mark.parametrize("name,blocks", _documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_python_examples_run(name, blocks, tmp_path, monkeypatch, capsys):
    assert len(blocks) >= 3, f"{name}: expected the cache, collect and evaluate examples"
    joined = "\n".join(blocks)
    for needed in ("CompressedCache.from_recipe", "generate(", "kvcalib.collect(", "kvcalib.evaluate("):
        assert needed in joined, f"{name} lacks an example of {needed}"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    t0 = time.perf_counter()
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{name}[python block {i + 1}]", "exec"), namespace)
        except Exception as err:  # name the block that failed
            raise AssertionError(f"{name}: python block {i + 1} failed: {type(err).__name__}: {err}\n{code}") from err
    wall = time.perf_counter() - t0
    out = capsys.readouterr().out
    assert "bits per K/V element" in out and "full precision" in out
    assert (tmp_path / "runs" / "smol" / "stats.safetensors").is_file()
    # ~45 s on 2 idle CPU cores; the guard is loose because shared machines run slower
    assert wall < 180, f"{name}: the examples took {wall:.0f} s; keep them small"
