"""Issue 53 item 2, a search that keeps copying, on tiny models: copy windows repeat the start of
their scoring window exactly, the objective scores them apart from the ordinary windows and combines
the two (a weighted geometric mean), ``copy_weight`` / ``--copy-weight`` and their checks, a study
refusing another weight, and the parts in ``search.json`` / ``report.md``. (That the copy part
catches a recipe destroying far-back keys needs a model that copies: the real one, in
tests/integration/test_search_copy_embedded.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from kvcalib.errors import KvcalibError
from tests.conftest import tiny_search_inputs

TINY_SPACE = {"bits": [2, 4, 8], "groups": [8], "windows": [8, 16], "sinks": [0, 2], "layer_methods": []}


@pytest.fixture(scope="module")
def tiny():
    return tiny_search_inputs()


# ------------------------------------------------------------------ the windows
@pytest.mark.parametrize("offset", [0, 1], ids=["no-bos", "bos"])
def test_copy_windows_repeat_the_start_of_the_window(offset):
    from kvcalib.eval.copy import copy_windows

    windows = torch.randint(0, 1000, (3, 41), generator=torch.Generator().manual_seed(1))  # (N, T), T odd
    tail = 7
    inputs = copy_windows(windows, tail, offset)
    span = 2 * tail  # the copy's first tail tokens lead into the scored ones
    assert inputs.ids.shape == windows.shape and inputs.passage_len == span and inputs.offset == offset
    assert torch.equal(inputs.ids[:, -span:], windows[:, offset:offset + span])  # an exact copy of the start
    assert torch.equal(inputs.ids[:, :41 - span], windows[:, :41 - span])  # the rest untouched, BOS included
    assert inputs.prompt_len == 41 - tail  # the scored decode steps are the copy's end
    room = (41 - offset) // 2
    assert copy_windows(windows, room, offset).passage_len == room  # the copy as long as the source may be
    with pytest.raises(ValueError, match="at most"):
        copy_windows(windows, room + 1, offset)  # the copy would overlap its source


def test_eval_copy_inputs_are_the_same_repeat(tiny_tokenizer):
    """The eval metric's [BOS] P P and the search's windows come from one function (repeat_span)."""
    from kvcalib.eval.copy import build_copy_inputs, repeat_span
    from tests.conftest import corpus_lines

    texts = ["\n".join(corpus_lines(60, seed=s)) for s in range(2)]
    inputs = build_copy_inputs(texts, tiny_tokenizer, passage_len=20, tail=5, n=2)
    assert torch.equal(inputs.ids, repeat_span(inputs.ids[:, :20], 0, 20))
    with pytest.raises(ValueError, match="outside"):
        repeat_span(inputs.ids[:, :20], 5, 16)


# ------------------------------------------------------------------ the objective
def test_objective_scores_copy_windows_apart_and_combines_them(tiny):
    from kvcalib.eval.copy import copy_windows
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point

    model, info, stats, ids = tiny
    copies = copy_windows(ids, 8).ids  # (2, 40)
    plain = SearchObjective(model, info, stats, ids, context=256, score_last=8)
    both = SearchObjective(model, info, stats, ids, context=256, score_last=8, copy_ids=copies, copy_weight=0.5)
    assert both.n_sequences == 4 and both.order() == [0, 2, 1, 3] and both.sweep_sequences == [0, 2]
    point = Point(8, 8, 0, (2, 2), (2, 2), ((), ()))
    steps: list[tuple[int, float]] = []
    parts = both.parts(point, report=lambda s, v: steps.append((s, v)))
    assert parts.ordinary == pytest.approx(plain.kl(point), rel=1e-9)  # the ordinary part is the old objective
    assert parts.copy > 0 and parts.copy != parts.ordinary
    assert parts.value == pytest.approx(math.sqrt(parts.ordinary * parts.copy), rel=1e-12)
    assert [s for s, _ in steps] == [0, 1, 2, 3] and steps[-1][1] == pytest.approx(parts.value, rel=1e-12)
    assert both.kl(point) == pytest.approx(parts.value, rel=1e-9)
    heavy = SearchObjective(model, info, stats, ids, context=256, score_last=8, copy_ids=copies, copy_weight=0.9)
    assert heavy.kl(point) == pytest.approx(parts.ordinary ** 0.1 * parts.copy ** 0.9, rel=1e-9)
    with pytest.raises(ValueError, match="score_last"):
        SearchObjective(model, info, stats, ids, context=256, copy_ids=copies)
    with pytest.raises(ValueError, match="copy_ids"):
        SearchObjective(model, info, stats, ids, context=256, score_last=8, copy_ids=copies[:, :20])


# ------------------------------------------------------------------ the switch
def test_copy_weight_defaults_follow_the_scored_decode_steps(tmp_path):
    from kvcalib.optimize import COPY_WEIGHT, SearchConfig

    base = dict(out=tmp_path / "r", seq_len=256, context=4096)
    assert SearchConfig(**base, score_seq_len=512, score_last=64).copy_weight == COPY_WEIGHT  # decode steps: on
    assert SearchConfig(**base, score_seq_len=256).copy_weight == 0.0  # `make demo`: every position scored, off
    assert SearchConfig(**base, score_at_context=True).copy_weight == COPY_WEIGHT  # `kvcalib search`'s default
    assert SearchConfig(**base, score_seq_len=512, score_last=300).copy_weight == 0.0  # no room for a copy
    assert SearchConfig(**base, score_seq_len=512, score_last=64, copy_weight=0).copy_weight == 0.0
    assert SearchConfig(**base, score_seq_len=512, score_last=255, copy_weight=0.2).copy_weight == 0.2


@pytest.mark.parametrize("kw,match", [
    ({"copy_weight": 1.0}, r"--copy-weight must be a number in \[0, 1\)"),
    ({"copy_weight": -0.1}, r"--copy-weight must be a number in \[0, 1\)"),
    ({"copy_weight": float("nan")}, r"--copy-weight must be a number"),
    ({"copy_weight": True}, r"--copy-weight must be a number"),
    ({"copy_weight": "half"}, r"--copy-weight must be a number"),
    ({"copy_weight": 0.5, "score_last": None}, r"--copy-weight 0.5 needs .*--score-last N \(at most 255"),
    ({"copy_weight": 0.5, "score_last": 256}, r"at most 255 scored positions.*--score-last 255 or less"),
], ids=["one", "negative", "nan", "bool", "string", "no-decode-steps", "no-room"])
def test_bad_copy_weight_is_refused_naming_the_fix(tmp_path, kw, match):
    from kvcalib.optimize import SearchConfig

    args = dict(out=tmp_path / "r", seq_len=256, context=4096, score_seq_len=512, score_last=64)
    args.update(kw)
    with pytest.raises(KvcalibError, match=match):
        SearchConfig(**args)


def test_cli_refuses_a_bad_copy_weight_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from kvcalib.cli import app

    res = CliRunner().invoke(app, ["search", "--out", str(tmp_path / "r"), "--context", "1024",
                                   "--copy-weight", "1.5"])
    assert res.exit_code == 2, res.output
    assert "--copy-weight must be a number in [0, 1)" in res.output and "Traceback" not in res.output


def test_a_study_refuses_another_copy_weight(tmp_path):
    from kvcalib.optimize import SearchConfig
    from kvcalib.optimize.guards import check_same_objective, objective_record

    cfg = SearchConfig(out=tmp_path / "r", seq_len=256, context=4096, score_seq_len=512, score_last=64)
    check_same_objective(objective_record(cfg), cfg, "r")
    recorded = {k: v for k, v in objective_record(cfg).items() if k != "copy_weight"}  # a study from before
    with pytest.raises(KvcalibError, match=r"--copy-weight 0.5 differs .* made with --copy-weight 0.0"):
        check_same_objective(recorded, cfg, "r")


# ------------------------------------------------------------------ the report
def test_search_reports_both_parts(tiny, tmp_path):
    from kvcalib.optimize import SearchConfig, search_with
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.report import held_out_rows
    from kvcalib.optimize.space import SearchSpace

    model, info, stats, ids = tiny
    floor = SearchObjective(model, info, stats, ids, context=256).effective_bits(
        SearchSpace.from_dict(TINY_SPACE).floor_point(info.num_layers), with_tensors=False)
    run = tmp_path / "run"
    run.mkdir()  # search() makes the run folder (collection); search_with writes into it
    cfg = SearchConfig(out=run, trials=3, budget_bits=round(floor + 1.0, 3), space=dict(TINY_SPACE), eval=False,
                       presets=("kivi-2",), context=256, score_last=8, sweep=False)
    doc = search_with(cfg, model, info, stats, ids, run, progress=False)
    assert doc["copy_weight"] == 0.5 and doc["copy_sequences"] == 2 and doc["copy_span"] == 16
    assert doc["score_sequences"] == 2 and doc["config"]["copy_weight"] == 0.5
    done = [t for t in doc["trials"] if t["state"] == "COMPLETE"]
    assert done and all(t["kl"] == pytest.approx(math.sqrt(t["kl_ordinary"] * t["kl_copy"]), rel=1e-9) for t in done)
    preset = doc["presets"][0]
    assert preset["kl_copy"] > 0 and preset["kl"] == pytest.approx(math.sqrt(preset["kl_ordinary"] * preset["kl_copy"]))
    chosen = next(t for t in doc["trials"] if t["number"] == doc["chosen"])
    report = (run / "report.md").read_text()
    assert f"(ordinary {chosen['kl_ordinary']:.4g}, copy {chosen['kl_copy']:.4g})" in report
    assert "2 copy window(s)" in report and "| KL ordinary | KL copy |" in report
    from kvcalib.recipe import Recipe

    prov = Recipe.load(run / "recipe.safetensors").provenance
    assert prov["copy_weight"] == 0.5 and prov["kl_copy"] == chosen["kl_copy"]
    # the held-out proof's copy columns (the held-out rows of kvcalib.eval.harness.EvalResult)
    rows = [{"name": "searched", "effective_bits": 3.0, "ppl": 10.0, "ppl_fp": 9.9, "ppl_delta_pct": 1.0,
             "copy_nll": 0.6, "copy_nll_fp": 0.3}]
    cols, table = held_out_rows(rows, {"searched": 0.01}, "searched")
    assert cols[6:9] == ["copy NLL", "copy NLL fp", "copy × fp"] and table[0][6:9] == [0.6, 0.3, 2.0]
