"""scripts/bits_floor.py: the sub-3-bit floors docs/results.md quotes come from the byte accounting."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("bits_floor", ROOT / "scripts" / "bits_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_floors_add_up_and_match_the_closed_form(tmp_path):
    module = _script()
    out = tmp_path / "floor.md"
    assert module.main(["--out", str(out)]) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()[2:]]
    assert len(rows) == len(module.SHAPES) * len(module.LAYOUTS)
    for row in rows:
        total, codes, scales, fp, eight = (float(c.strip().strip("*")) for c in row[5:10])
        assert abs(codes + scales + fp - total) < 2e-3  # the components are the whole
        assert abs(codes + scales / 2 + fp - eight) < 2e-3
    # no window, groups of 64: every element a 2-bit code plus a float16 scale and zero per 64
    # (keys per channel over 64 tokens, values per token over 64 channels): 2 + 32 / 64 bits exactly
    no_window = [r for r in rows if r[0].strip() == "SmolLM2-135M" and r[2].strip() == "64" and r[4].strip() == "0 + 0"]
    assert [float(no_window[0][5].strip().strip("*"))] == [2.5]
    assert not list(tmp_path.glob("*.tmp"))
