"""bench_host's report: the tables and the plot from its JSON (the runs themselves need CUDA)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvcalib_kernels.bench import bench_host

BENCH = Path(__file__).resolve().parents[2] / "artifacts" / "bench"


def test_report_from_the_committed_runs(tmp_path):
    for name in ("host.json", "host_before.json"):
        shutil.copy(BENCH / name, tmp_path / name)
    bench_host.main(["--mode", "report", "--out", str(tmp_path)])
    md = (tmp_path / "host.md").read_text()
    now = json.loads((tmp_path / "host.json").read_text())
    for row in now["eager"]:  # each row's own ratio, as the table prints it
        assert f"{row['kvcalib_eager_tok_s'] / row['bf16_eager_tok_s']:.2f}x" in md
    assert "before run" in md and (tmp_path / "host.png").stat().st_size > 10_000


def test_report_without_a_before_run(tmp_path):
    shutil.copy(BENCH / "host.json", tmp_path / "host.json")
    bench_host.main(["--mode", "report", "--out", str(tmp_path)])
    assert "before run" not in (tmp_path / "host.md").read_text()
