"""The search-curve report (benchmarks.search_curve) on a fake finished run: budgets, the curve
document, the issue's targets, the markdown table and the PNG. No model is loaded."""

from __future__ import annotations

import json

import pytest

from benchmarks import search_curve as curve

PRESET_BITS = {"fp16": 16.0, "kivi-2": 3.40625, "kivi-4": 5.34375, "pertoken-4": 4.5}


def test_budgets_match_presets_exactly_and_skip_the_impossible():
    budgets = curve.curve_budgets(PRESET_BITS, floor=2.7109375, extra=(2.0, 6.0, 3.0))
    assert budgets == [("2.82b", 2.82), ("3.00b", 3.0), ("kivi-2", 3.40625), ("4.00b", 4.0),
                       ("pertoken-4", 4.5), ("kivi-4", 5.34375), ("6.00b", 6.0)]
    # a budget equal to a preset's bits keeps the preset's label
    assert ("kivi-2", 3.40625) in curve.curve_budgets(PRESET_BITS, floor=2.7, extra=(3.40625,))
    # below the floor of the space nothing can be searched
    assert all(b >= 3.5 for _, b in curve.curve_budgets(PRESET_BITS, floor=3.5))


def _search_json(kl: float, bits: float, trial: int = 3) -> dict:
    point = {"group": 32, "window": 64, "sinks": 0, "k_axis": "channel", "k_bits": [2, 4], "v_bits": [2, 2],
             "methods": [[], ["clip"]]}
    return {"chosen": trial, "seconds": 12.5,
            "trials": [{"number": n, "state": "COMPLETE", "kl": kl * (1 + n), "effective_bits": bits,
                        "point": point} for n in range(trial)] +
                      [{"number": trial, "state": "COMPLETE", "kl": kl, "effective_bits": bits, "point": point}]}


@pytest.fixture()
def fake_run(tmp_path):
    run = tmp_path / "curve-run"
    budgets = [("2.82b", 2.82), ("3.00b", 3.0), ("kivi-2", 3.40625), ("kivi-4", 5.34375)]
    curve.write_plan(run, "tiny-model", budgets, PRESET_BITS,
                     {"trials": 40, "samples": 8, "seq_len": 256, "score_samples": 2, "ppl_samples": 8,
                      "ppl_seq_len": 1024})
    searched = {"2.82b": (0.09, 2.8, 30.9, 12.3), "3.00b": (0.05, 2.99, 27.7, 0.7),
                "kivi-2": (0.03, 3.40, 28.0, 1.8), "kivi-4": (0.001, 5.34, 27.6, 0.36)}
    results = []
    for label, (kl, bits, ppl, delta) in searched.items():
        (run / f"budget-{label}").mkdir()
        (run / f"budget-{label}" / "search.json").write_text(json.dumps(_search_json(kl, bits)))
        results.append({"name": "tiny-search-trial3", "recipe": str(run / "points" / f"{label}.safetensors"),
                        "effective_bits": bits, "ppl": ppl, "ppl_fp": 27.5, "ppl_delta_pct": delta})
    results += [{"name": "fp16", "recipe": "fp16", "effective_bits": 16.0, "ppl": 27.5, "ppl_fp": 27.5, "ppl_delta_pct": 0.0},
                {"name": "kivi-2", "recipe": "kivi-2", "effective_bits": 3.40625, "ppl": 30.5, "ppl_fp": 27.5,
                 "ppl_delta_pct": 10.9},
                {"name": "kivi-4", "recipe": "kivi-4", "effective_bits": 5.34375, "ppl": 27.55, "ppl_fp": 27.5,
                 "ppl_delta_pct": 0.18},
                {"name": "pertoken-4", "recipe": "pertoken-4", "effective_bits": 4.5, "ppl": 30.1, "ppl_fp": 27.5,
                 "ppl_delta_pct": 9.5}]
    (run / "eval.json").write_text(json.dumps(results))
    return run


def test_curve_report_from_a_fake_run(fake_run, tmp_path):
    out = tmp_path / "results"
    paths = curve.write_curve(fake_run, out)
    assert paths["json"].name == "search-curve-tiny-model.json"
    doc = json.loads(paths["json"].read_text())
    assert [p["label"] for p in doc["points"]] == ["2.82b", "3.00b", "kivi-2", "kivi-4"]
    p2 = doc["points"][2]
    assert p2["matches"] == "kivi-2" and p2["ppl"] == 28.0 and p2["search_kl"] == 0.03 and p2["trial"] == 3
    assert p2["trials"] == 4 and p2["recipe"].endswith("points/kivi-2.safetensors")
    assert str(tmp_path) not in paths["json"].read_text()  # no machine paths
    assert {p["name"] for p in doc["presets"]} == {"fp16", "kivi-2", "kivi-4", "pertoken-4"}
    assert doc["ppl_fp"] == 27.5
    met = [t["met"] for t in doc["targets"]]
    assert met == [True, False, True]  # 28.0 < 30.5; 27.6 > 27.55; 0.7% at 2.99 bits
    assert doc["targets"][2]["best_label"] == "3.00b"
    md = paths["md"].read_text()
    assert "| searched @ kivi-2 | 3.406 | 3.4 | 0.03 | 28 | 1.8 | 3 of 4 |" in md
    assert md.index("searched @ 2.82b") < md.index("| kivi-2 |") < md.index("pertoken-4")  # by effective bits
    assert "**met**" in md and "**not met**" in md and "](search-curve-tiny-model.png)" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curve_targets_unmeasured_and_cli_errors(fake_run, tmp_path, capsys):
    (fake_run / "eval.json").write_text(json.dumps([]))
    doc = curve.collect_curve(fake_run)
    assert [t["met"] for t in doc["targets"]] == [None, None, None]
    assert "not measured" in curve.markdown(doc)
    assert curve.main(["report", "--run", str(tmp_path / "missing"), "--out-dir", str(tmp_path / "r")]) == 2
    assert "not a finished search-curve run" in capsys.readouterr().err



def test_report_names_keep_dotted_model_names(fake_run, tmp_path):
    """A model alias with a dot (qwen2.5-coder-0.5b) must not lose its tail to a file suffix."""
    plan = json.loads((fake_run / "curve-plan.json").read_text())
    plan["model"] = "qwen2.5-coder-0.5b"
    (fake_run / "curve-plan.json").write_text(json.dumps(plan))
    paths = curve.write_curve(fake_run, tmp_path / "r")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
        "search-curve-qwen2.5-coder-0.5b.json", "search-curve-qwen2.5-coder-0.5b.md",
        "search-curve-qwen2.5-coder-0.5b.png"]
    assert "](search-curve-qwen2.5-coder-0.5b.png)" in paths["md"].read_text()
