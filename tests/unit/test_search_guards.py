"""Search guards (issue 36): a scoring length that quantizes nothing is refused, a study keeps one
objective, a failed start leaves no study behind, unusable statistics and unfitting presets are
found before any trial (``kvcalib/optimize/guards.py``)."""

from __future__ import annotations

import pytest

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig
from kvcalib.optimize import SearchConfig
from kvcalib.optimize import guards
from kvcalib.optimize.space import SearchSpace, SpaceError
from kvcalib.simulate import quantized_mask
from tests.conftest import corpus_lines, tiny_loaded_model

SPACE = {"bits": [2, 4, 8], "groups": [8], "windows": [8, 16], "sinks": [0, 2], "layer_methods": ["clip"]}


@pytest.mark.parametrize("space", [SPACE, {**SPACE, "groups": [8, 16], "windows": [0, 16, 32]},
                                   {**SPACE, "k_axis": "token", "windows": [0]}],
                         ids=["tiny", "mixed", "per-token"])
def test_min_quantized_length_is_where_the_largest_point_first_quantizes(space):
    """The guard's length agrees with the simulation's mask: at it the largest point's last query
    sees a quantized token, one token shorter none does."""
    s = SearchSpace.from_dict(space)
    need = guards.min_quantized_length(s)
    cfg = LayerConfig(k_bits=2, v_bits=2, k_axis=s.k_axis, k_group=max(s.groups), v_group=max(s.groups),
                      sinks=max(s.sinks), window=max(s.windows))
    assert bool(quantized_mask(cfg, need, prompt_len=1).any())
    assert not bool(quantized_mask(cfg, need - 1, prompt_len=1).any())
    guards.check_quantized_scoring(s, need)
    with pytest.raises(SpaceError, match=f"--seq-len {need} or more"):
        guards.check_quantized_scoring(s, need - 1)


def test_search_config_refuses_a_scoring_length_that_quantizes_nothing():
    with pytest.raises(SpaceError, match="no point of the search space quantizes a single scored token"):
        SearchConfig(seq_len=64)  # default space: window >= 64 -> every trial would score the same
    with pytest.raises(SpaceError, match=r"score as lossless.*--seq-len 197"):
        SearchConfig(seq_len=150)  # window 64 quantizes, window 128 + group 64 + sinks 4 does not
    assert SearchConfig(seq_len=197).seq_len == 197


# ------------------------------------------------------------------ fixtures: a run folder
@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_tokenizer):
    """A tiny loaded model and a run folder with its statistics on a text file."""
    from kvcalib.collection import CollectConfig, collect

    root = tmp_path_factory.mktemp("guards")
    text = root / "text.txt"
    text.write_text("\n".join(corpus_lines(2000, seed=3)))
    loaded = tiny_loaded_model(tiny_tokenizer)
    collect(CollectConfig(model="tiny", data=str(text), samples=4, seq_len=48, block_len=16, reservoir_blocks=4),
            root / "run", loaded=loaded)
    return loaded, root / "run", text


def _config(run_dir, text, **kw):
    base = dict(model="tiny", data=str(text), out=run_dir, samples=4, seq_len=48, score_samples=2, trials=2,
                budget_bits=12.0, context=256, space=dict(SPACE), eval=False, presets=(), sweep=True)
    base.update(kw)
    return SearchConfig(**base)


def _copy(run_dir, dest):
    import shutil

    shutil.copytree(run_dir, dest)
    return dest


def test_failed_start_leaves_no_study_and_an_interrupted_one_stays_resumable(run, tmp_path, monkeypatch):
    from kvcalib.optimize import search, study

    loaded, run_dir, text = run
    folder = _copy(run_dir, tmp_path / "run")

    def boom(*args, **kwargs):
        raise RuntimeError("the sweep broke")

    monkeypatch.setattr(study, "sensitivity_sweep", boom)
    with pytest.raises(RuntimeError, match="the sweep broke"):
        search(_config(folder, text), loaded=loaded, progress=False)
    assert not (folder / "study.db").exists() and (folder / "stats.safetensors").is_file()
    with pytest.raises(KvcalibError, match="no study yet"):  # not stuck: --resume says to drop it...
        guards.check_study_before_work(_config(folder, text, resume=True))
    guards.check_study_before_work(_config(folder, text))  # ...and a plain start is accepted

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(study, "sensitivity_sweep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        search(_config(folder, text), loaded=loaded, progress=False)
    assert (folder / "study.db").is_file()  # Ctrl-C keeps the study: it resumes
    guards.check_study_before_work(_config(folder, text, resume=True))
    with pytest.raises(KvcalibError, match="pass --resume"):
        guards.check_study_before_work(_config(folder, text))


def test_a_study_keeps_one_objective(run, tmp_path):
    from kvcalib.optimize import search

    loaded, run_dir, text = run
    folder = _copy(run_dir, tmp_path / "run")
    doc = search(_config(folder, text), loaded=loaded, progress=False)
    assert doc.n_trials == 2
    for change, option in ((dict(seq_len=40), "--seq-len 40"), (dict(score_samples=1), "--score-samples 1"),
                           (dict(budget_bits=13.0), "--budget-bits 13.0"), (dict(seed=1), "--seed 1"),
                           (dict(context=512), "--context 512")):
        cfg = _config(folder, text, resume=True, trials=3, **change)
        with pytest.raises(KvcalibError, match=option.replace(".", r"\.") + " differs from the study"):
            guards.check_study_before_work(cfg)  # before any model loads
        with pytest.raises(KvcalibError, match=option.replace(".", r"\.") + " differs from the study"):
            search(cfg, loaded=loaded, progress=False)  # and in the search itself
    again = search(_config(folder, text, resume=True, trials=3), loaded=loaded, progress=False)
    assert again.n_trials == 3


def test_nan_statistics_are_refused_before_work(run, tmp_path):
    from kvcalib.stats import CollectedStats

    _, run_dir, text = run
    folder = _copy(run_dir, tmp_path / "run")
    stats = CollectedStats.load(folder)
    stats.layers[1].k["absmax"][0, 0] = float("nan")
    stats.save(folder / "stats.safetensors")
    with pytest.raises(KvcalibError, match=r"layer 1: statistics field k\.absmax holds NaN"):
        guards.check_stats_before_work(folder)


def test_presets_that_do_not_fit_the_model_are_left_out(run):
    loaded, _, _ = run
    info = loaded.info  # head_dim 16: every shipped group of 32 or 64 channels is too wide
    assert guards.presets_for(("kivi-2", "fp16", "pertoken-4"), info) == ("fp16",)
    wide = info.__class__(**{**info.to_dict(), "head_dim": 64, "sliding_window": info.sliding_window})
    assert guards.presets_for(("kivi-2", "pertoken-4"), wide) == ("kivi-2", "pertoken-4")


def test_storage_lost_tells_a_vanished_or_replaced_study_from_a_bug(tmp_path):
    from kvcalib.optimize.study import open_study

    journal = tmp_path / "study.log"
    space = SearchSpace.from_dict(SPACE)
    open_study(f"journal:{journal}", "mine", space, 2)
    cfg = SearchConfig(out=tmp_path / "run", storage=f"journal:{journal}", study="mine", space=dict(SPACE), seq_len=64)
    assert guards.storage_lost(cfg) is None  # intact: an unexplained error is a bug
    journal.rename(tmp_path / "moved.log")
    assert "disappeared while the search ran" in guards.storage_lost(cfg)
    open_study(f"journal:{journal}", "someone-else", space, 2)  # a new file in its place
    assert "no longer holds study 'mine'" in guards.storage_lost(cfg)
    journal.write_bytes(b"\xff\xfe not a journal")  # Optuna skips lines it cannot parse: no study left
    assert str(journal) in guards.storage_lost(cfg)


def test_a_budget_with_no_room_above_the_floor_is_refused_with_the_budget_that_works(run, tmp_path):
    """Between the cheapest point and the cheapest point with one layer's values a level up, every
    trial is the cheapest point: refused before any work, naming the budget that leaves room; at
    that budget the search runs."""
    import math
    import re

    from kvcalib.optimize import search

    loaded, run_dir, text = run
    folder = _copy(run_dir, tmp_path / "run")
    import torch

    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.study import floor_bits

    counter = SearchObjective(loaded.model, loaded.info, None, torch.zeros(1, 2, dtype=torch.long), context=256)
    floor = floor_bits(counter, _config(folder, text).space)
    with pytest.raises(KvcalibError, match=r"leaves no room to search.*Pass --budget-bits") as err:
        search(_config(folder, text, budget_bits=math.ceil(floor * 100) / 100 + 0.001), loaded=loaded, progress=False)
    needed = float(re.search(r"Pass --budget-bits ([0-9.]+)", str(err.value)).group(1))
    assert needed > floor
    assert not (folder / "study.db").exists()  # refused before the study is created
    doc = search(_config(folder, text, budget_bits=needed), loaded=loaded, progress=False)
    assert doc.n_trials == 2
