"""benchmarks/host.py's report: the tables and the plot from its JSON (the runs themselves need CUDA)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import host as bench_host

BENCH = Path(__file__).resolve().parents[2] / "artifacts" / "bench"


def test_report_from_the_committed_run_and_a_before_run(tmp_path):
    """The committed run, and the same JSON standing in as a run over an older checkout (the
    before columns: a run of the script over another commit, in the same device session)."""
    shutil.copy(BENCH / "host.json", tmp_path / "host.json")
    before = json.loads((BENCH / "host.json").read_text())
    before["code"] = "commit 0000000"
    before["per_call"][0]["kvcalib_us"] = 999.5
    (tmp_path / "host_before.json").write_text(json.dumps(before))
    bench_host.main(["--mode", "report", "--out", str(tmp_path)])
    md = (tmp_path / "host.md").read_text()
    now = json.loads((tmp_path / "host.json").read_text())
    for row in now["eager"]:  # each row's own ratio, as the table prints it
        assert f"{row['kvcalib_eager_tok_s'] / row['bf16_eager_tok_s']:.2f}x" in md
    assert "before run" in md and "commit 0000000" in md and "| 999.5 |" in md
    assert (tmp_path / "host.png").stat().st_size > 10_000


def test_report_without_a_before_run(tmp_path):
    shutil.copy(BENCH / "host.json", tmp_path / "host.json")
    bench_host.main(["--mode", "report", "--out", str(tmp_path)])
    assert "before run" not in (tmp_path / "host.md").read_text()
