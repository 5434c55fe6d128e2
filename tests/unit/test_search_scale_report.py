"""scripts/search_scale.py's pure parts: the per-trial columns of a row and the ratios it prints
(the runs themselves need GPUs; tests/integration/test_search_scale.py runs the search paths)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "search_scale.py"
_spec = importlib.util.spec_from_file_location("search_scale", SCRIPT)
search_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(search_scale)


def _trial(number, worker, start, seconds, state="COMPLETE"):
    return {"number": number, "worker": worker, "state": state, "seconds": seconds,
            "started": f"2026-11-26T10:00:{start:09.6f}", "finished": f"2026-11-26T10:00:{start + seconds:09.6f}"}


def test_trial_stats_count_occupancy_pruning_and_the_slowest_trial():
    # worker a: 2 s + 1 s of a 5 s phase; worker b: 4 s (one pruned 1 s trial, one 3 s trial)
    doc = {"trials": [_trial(0, "a", 0.0, 2.0), _trial(1, "b", 0.0, 1.0, "PRUNED"), _trial(2, "a", 3.0, 1.0),
                      _trial(3, "b", 2.0, 3.0), {"number": 4, "state": "WAITING", "seconds": None}]}
    stats = search_scale.trial_stats(doc)
    assert stats == {"occupancy": 0.6, "median_complete_s": 2.0, "median_pruned_s": 1.0, "pruned": 1,
                     "slowest_trial_s": 3.0}
    rate, n, seconds = search_scale.trial_phase_rate(doc)
    assert (n, seconds) == (4, 5.0) and abs(rate - 48.0) < 1e-9


def test_ratio_lines_pair_each_repeat_and_take_the_median():
    rows = [{"repeat": r, "workers": w, "trials_per_min": t, "gpus": w}
            for r, w, t in ((0, 1, 30.0), (0, 2, 54.0), (1, 2, 57.5), (1, 1, 33.4), (2, 1, 31.0), (2, 2, 56.0))]
    (line,) = search_scale.ratio_lines(rows)
    assert line.startswith("2 workers / 2 GPUs: median 1.80x") and "over 3 repeat(s)" in line and "1.72x" in line
    assert search_scale.ratio_lines([r for r in rows if r["workers"] == 2]) == []  # no 1-worker row: no ratio


def test_a_reference_is_reused_only_when_its_search_finished_with_its_inputs(tmp_path):
    # a later call with the same --run goes on from the reference only if it is whole
    ref = tmp_path / "reference"
    assert not search_scale.reference_done(ref, 2)  # no folder
    ref.mkdir()
    (ref / "search.json").write_text('{"trials": [{"state": "COMPLETE"}, {"state": "RUNNING"}]}')
    (ref / "stats.safetensors").write_bytes(b"x")
    (ref / "run.json").write_text("{}")
    assert not search_scale.reference_done(ref, 2)  # cut short: one finished trial of two
    (ref / "search.json").write_text('{"trials": [{"state": "COMPLETE"}, {"state": "PRUNED"}]}')
    assert search_scale.reference_done(ref, 2)
    (ref / "run.json").unlink()
    assert not search_scale.reference_done(ref, 2)  # the timed runs copy its statistics and run.json
    (ref / "run.json").write_text("{}")
    (ref / "search.json").write_text("{not json")
    assert not search_scale.reference_done(ref, 2)
