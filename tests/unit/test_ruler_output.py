"""RULER rows rebuilt from lm-eval's results files (a run killed part-way), and kvcalib's sample
digest equal to lm-eval's task hash. Fake results files: no lm-eval run, no model."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from kvcalib.errors import KvcalibError
from kvcalib.models import ModelInfo

SMOL = ModelInfo("smollm2-135m", "llama", 30, 9, 3, 64, 8192, (None,) * 30, "cc1cfbf31f103bfa")
TASKS = ("niah_single_1", "ruler_vt")


def _results(root, folder, scores, hashes, seconds="12.5"):
    """One lm-eval results file as its EvaluationTracker writes it, under root/smollm2-135m/folder/."""
    path = root / "smollm2-135m" / folder / "results_2026-11-28T13-23-45.301372.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"results": {t: {"alias": t, "4096,none": -1, "8192,none": s, "8192_stderr,none": "N/A"}
                       for t, s in scores.items()},
           "n-samples": {t: {"original": 500, "effective": 50} for t in scores},
           "task_hashes": dict(hashes), "total_evaluation_time_seconds": seconds, "lm_eval_version": "0.4.13",
           "model_name_sanitized": folder}
    path.write_text(json.dumps(doc))
    return path


def _config(tmp_path, recipes=("kivi-2",)):
    from kvcalib.eval.tasks import TaskConfig

    return TaskConfig(model="smollm2-135m", recipes=list(recipes), tasks=TASKS, context=8192, limit=50,
                      output_path=tmp_path)


HASHES = {"niah_single_1": "a" * 64, "ruler_vt": "b" * 64}


def test_rows_rebuilt_from_results_files_without_lm_eval(tmp_path, monkeypatch):
    from kvcalib.eval.tasks import results_from_output

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # reading JSON must not need lm-eval
    _results(tmp_path, "full_precision", {"niah_single_1": 0.96, "ruler_vt": 0.5}, HASHES, seconds="68.64")
    older = _results(tmp_path, "kivi-2", {"niah_single_1": 0.0, "ruler_vt": 0.0}, HASHES)
    older.rename(older.with_name("results_2026-11-27T09-00-00.000000.json"))  # the newest file counts
    _results(tmp_path, "kivi-2", {"niah_single_1": 0.34, "ruler_vt": 0.25}, HASHES, seconds="127.72")
    rows, missing = results_from_output(_config(tmp_path, ("kivi-2", "kivi-4")), SMOL)
    assert missing == ["kivi-4"]
    got = {(r.name, r.task): r for r in rows}
    assert list(got) == [("full precision", "niah_single_1"), ("full precision", "ruler_vt"),
                         ("kivi-2", "niah_single_1"), ("kivi-2", "ruler_vt")]
    kivi = got["kivi-2", "niah_single_1"]
    assert (kivi.score, kivi.score_fp, kivi.n, kivi.metric) == (0.34, 0.96, 50, "8192,none")
    assert kivi.prompts_sha256 == "a" * 64 and got["kivi-2", "ruler_vt"].prompts_sha256 == "b" * 64
    assert kivi.seconds == 127.7 and kivi.lm_eval == "0.4.13" and kivi.recipe == "kivi-2"
    from kvcalib.recipe import resolve_recipe

    assert kivi.effective_bits == resolve_recipe("kivi-2").memory(SMOL, 8192).effective_bits < 16.0
    assert got["full precision", "ruler_vt"].effective_bits == 16.0
    assert got["full precision", "ruler_vt"].score == got["full precision", "ruler_vt"].score_fp == 0.5


def test_other_samples_and_a_missing_full_precision_are_refused(tmp_path):
    from kvcalib.eval.tasks import results_from_output

    with pytest.raises(KvcalibError, match="full_precision") as err:
        results_from_output(_config(tmp_path), SMOL)
    assert "--output-path" in str(err.value)
    _results(tmp_path, "full_precision", {"niah_single_1": 0.96, "ruler_vt": 0.5}, HASHES)
    _results(tmp_path, "kivi-2", {"niah_single_1": 0.34, "ruler_vt": 0.25}, {**HASHES, "ruler_vt": "c" * 64})
    with pytest.raises(KvcalibError, match="other ruler_vt samples than full precision"):
        results_from_output(_config(tmp_path), SMOL)


def test_digest_is_lm_evals_task_hash():
    from kvcalib.eval.tasks import _prompts_digest

    def h(text):
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    samples = [{"doc_id": i, "doc_hash": h(f"doc {i}"), "prompt_hash": h(f"prompt {i} é"), "target_hash": h(f"t{i}")}
               for i in (1, 0)]  # lm-eval hashes the samples in the order it lists them
    expected = h(h("doc 1") + h("prompt 1 é") + h("t1") + h("doc 0") + h("prompt 0 é") + h("t0"))
    assert _prompts_digest(samples) == expected


def test_ruler_from_output_records_the_original_run(tmp_path, monkeypatch):
    from benchmarks import ruler
    from kvcalib import models

    monkeypatch.setattr(models, "model_info_offline", lambda model: SMOL)
    lm = tmp_path / "lm_a"
    _results(lm, "full_precision", {"niah_single_1": 0.96, "ruler_vt": 0.5}, HASHES)
    _results(lm, "kivi-2", {"niah_single_1": 0.34, "ruler_vt": 0.25}, HASHES)
    out = tmp_path / "ruler.json"
    ruler.main(["--from-output", str(lm), "--model", "smollm2-135m", "--context", "8192", "--tasks", ",".join(TASKS),
                "--out", str(out), "--machine", "NVIDIA H200", "--command", "python3 benchmarks/ruler.py ..."])
    rows = json.loads(out.read_text())
    assert len(rows) == 4 and {r["recipe"] for r in rows} == {"full precision", "kivi-2"}  # kivi-4: no folder
    assert {(r["machine"], r["command"], r["lm_eval"]) for r in rows} == {
        ("NVIDIA H200", "python3 benchmarks/ruler.py ...", "0.4.13")}
    assert "| kivi-2 |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):  # --machine describes a run read back, not this one
        ruler.main(["--context", "8192", "--machine", "NVIDIA H200", "--out", str(out)])
    # --merge: another run's --out (a GPU machine's) joins this one, a row of the same recipe/task replaced
    other = tmp_path / "gpu.json"
    moved = [dict(r, score=0.5, machine="elsewhere") for r in rows if r["recipe"] == "kivi-2"]
    other.write_text(json.dumps(moved))
    ruler.main(["--merge", str(other), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert len(merged) == 4 and {r["machine"] for r in merged if r["recipe"] == "kivi-2"} == {"elsewhere"}
    with pytest.raises(SystemExit):  # neither --context nor --merge
        ruler.main(["--out", str(out)])


def test_merge_refuses_a_missing_or_foreign_file_in_one_line(tmp_path, capsys):
    from benchmarks import long_context, ruler

    bad = tmp_path / "notes.json"
    bad.write_text('{"not": "rows"}')
    for main in (ruler.main, long_context.main):
        for path in (tmp_path / "missing.json", bad):
            with pytest.raises(SystemExit) as exit_info:
                main(["--merge", str(path), "--out", str(tmp_path / "out.json")])
            assert exit_info.value.code == 2 and str(path) in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()  # nothing written


def test_rows_without_full_precision_are_paired_by_samples_when_merged(tmp_path, monkeypatch):
    """--no-fp: a process that skipped full precision reads its recipe's files alone (no
    full_precision folder needed), its rows carry score_fp None, and a merge with the
    full-precision process's rows pairs each with the score of the same task and samples."""
    from benchmarks import ruler
    from kvcalib import models
    from kvcalib.eval.tasks import TaskConfig, results_from_output

    monkeypatch.setattr(models, "model_info_offline", lambda model: SMOL)
    lm = tmp_path / "lm_recipes"
    _results(lm, "kivi-2", {"niah_single_1": 0.34, "ruler_vt": 0.25}, HASHES)
    config = TaskConfig(model="smollm2-135m", recipes=["kivi-2"], tasks=TASKS, context=8192, limit=50,
                        output_path=lm, full_precision=False)
    rows, missing = results_from_output(config, SMOL)
    assert not missing and {(r.name, r.score_fp) for r in rows} == {("kivi-2", None)}
    recipes_out, fp_out, out = tmp_path / "recipes.json", tmp_path / "fp.json", tmp_path / "ruler.json"
    ruler.main(["--from-output", str(lm), "--no-fp", "--baselines", "kivi-2", "--model", "smollm2-135m",
                "--context", "8192", "--tasks", ",".join(TASKS), "--out", str(recipes_out)])
    assert "| kivi-2 |" in recipes_out.with_suffix(".md").read_text()  # a row with its vs fp blank
    lm_fp = tmp_path / "lm_fp"
    _results(lm_fp, "full_precision", {"niah_single_1": 0.96, "ruler_vt": 0.5},
             {**HASHES, "ruler_vt": "c" * 64})  # ruler_vt: other samples than the recipe's
    ruler.main(["--from-output", str(lm_fp), "--baselines", "", "--model", "smollm2-135m", "--context", "8192",
                "--tasks", ",".join(TASKS), "--out", str(fp_out)])
    ruler.main(["--merge", str(recipes_out), "--merge", str(fp_out), "--out", str(out)])
    got = {(r["recipe"], r["task"]): r["score_fp"] for r in json.loads(out.read_text())}
    assert got["kivi-2", "niah_single_1"] == 0.96  # same samples: paired
    assert got["kivi-2", "ruler_vt"] is None  # other samples: never paired with another run's score
    with pytest.raises(SystemExit) as exit_info:  # --no-fp with nothing else would run nothing
        ruler.main(["--no-fp", "--baselines", "", "--context", "8192", "--out", str(tmp_path / "none.json")])
    assert exit_info.value.code == 2
