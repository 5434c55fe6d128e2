"""``kvcalib search`` on tiny random models: space validation, the KL objective, the budget,
storage (resume, two workers, another space), export of searched points, written outputs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kvcalib.errors import KvcalibError
from tests.conftest import tiny_search_inputs

TINY_SPACE = {"bits": [2, 4, 8], "groups": [8], "windows": [8, 16], "sinks": [0, 2], "layer_methods": ["clip"]}


# ------------------------------------------------------------------ space
def test_default_space_and_files(tmp_path):
    from kvcalib.optimize.space import SearchSpace

    s = SearchSpace()
    assert s.bits == (2, 3, 4, 8) and "clip" in s.layer_methods
    f = tmp_path / "space.yaml"
    f.write_text("bits: [2, 4]\ngroups: [32]\nwindows: [32, 64]\n")
    s2 = SearchSpace.from_file(f)
    assert s2.bits == (2, 4) and s2.fingerprint(30) != s.fingerprint(30)
    assert s.fingerprint(30) == SearchSpace().fingerprint(30)


@pytest.mark.parametrize("text,match", [
    ("", "empty"),
    ("{}", "empty"),
    ('{"bitz": [2]}', "unknown keys"),
    ('{"bits": [5]}', "not allowed"),
    ('{"bits": [16]}', "not allowed"),
    ('{"bits": []}', "empty"),
    ('{"groups": [64], "windows": [32]}', "shorter than group"),
    ('{"layer_methods": ["schedule"]}', "global choice"),
    ('{"layer_methods": ["huffman"]}', "unknown method"),
    ("{not json", "not valid JSON"),
    ('{"schedules": []}', "empty"),
    ('{"schedules": "none"}', "must be a list"),
    ('{"schedules": ["fast"]}', "unknown schedule"),
    ('{"schedules": ["ages:4096,1024"]}', "strictly increasing"),
    ('{"schedules": ["ages:x"]}', "strictly increasing"),
    ('{"windows": [64, 128], "schedules": ["ages:100"]}', "inside the full-precision window"),
    ('{"schedules": ["none", "middle-heavy"]}', "sinks include 0"),
    ('{"sinks": [4], "schedules": ["old-heavy"]}', "keeps no sinks"),
    ('{"schedules": ["new-heavy"]}', "lowest bits from the start"),
], ids=["empty-file", "empty-object", "unknown-key", "bits-5", "bits-16", "no-bits", "short-window",
        "schedule-as-layer-method", "unknown-method", "bad-json", "no-schedules", "schedules-string",
        "unknown-schedule", "ages-decreasing", "ages-not-int", "age-in-window", "middle-heavy-no-sinks",
        "old-heavy-sinks", "new-heavy"])
def test_space_file_errors(tmp_path, text, match):
    from kvcalib.optimize.space import SearchSpace

    f = tmp_path / "space.json"
    f.write_text(text)
    with pytest.raises(KvcalibError, match=match):
        SearchSpace.from_file(f)


def test_import_kvcalib_optimize_is_lean():
    code = "import kvcalib, kvcalib.optimize, sys; print('optuna' in sys.modules, 'matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny():
    return tiny_search_inputs()


def _config(tmp_path, **kw):

    base = dict(out=tmp_path / "run", trials=4, budget_bits=None, space=dict(TINY_SPACE), eval=False,
                presets=("kivi-2",), context=256)
    base.update(kw)
    return base


def _floor(tiny, space=TINY_SPACE, context=256):
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import SearchSpace

    model, info, stats, ids = tiny
    obj = SearchObjective(model, info, stats, ids, context=context)
    return obj, obj.effective_bits(SearchSpace.from_dict(space).floor_point(info.num_layers), with_tensors=False)


# ------------------------------------------------------------------ objective
def test_objective_kl_zero_for_fp16_positive_for_2bit(tiny):
    from kvcalib.optimize.space import Point
    from kvcalib.layout import LayerConfig

    obj, _ = _floor(tiny)
    fp = [LayerConfig()] * 2
    assert obj.kl_configs(fp) == 0.0
    p2 = Point(8, 8, 0, (2, 2), (2, 2), ((), ()))
    p8 = Point(8, 8, 0, (8, 8), (8, 8), ((), ()))
    kl2, kl8 = obj.kl(p2), obj.kl(p8)
    assert kl2 > 0 and kl2 > kl8 >= 0
    assert obj.effective_bits(p2) < obj.effective_bits(p8)
    # clip on: fitted tensors exist and are cached
    pc = Point(8, 8, 0, (2, 2), (2, 2), (("clip",), ("clip",)))
    assert "layers.0.k.clip" in obj.fitted_tensors(pc)
    assert obj.fitted_tensors(pc)["layers.0.k.clip"] is obj.fitted_tensors(pc)["layers.0.k.clip"]
    steps = []
    obj.kl(p2, report=lambda s, v: steps.append((s, v)))
    assert [s for s, _ in steps] == [0, 1] and abs(steps[-1][1] - kl2) < 1e-12


def test_budget_below_floor_is_refused(tiny, tmp_path):
    from kvcalib.optimize import SearchConfig, search_with

    model, info, stats, ids = tiny
    _, floor = _floor(tiny)
    cfg = SearchConfig(**_config(tmp_path, budget_bits=floor - 0.5))
    with pytest.raises(KvcalibError, match=f"floor.*{floor:.3f}"):
        search_with(cfg, model, info, stats, ids, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "study.db").exists()


# ------------------------------------------------------------------ the search
@pytest.fixture(scope="module")
def searched(tiny, tmp_path_factory):
    from kvcalib.optimize import SearchConfig, search_with

    model, info, stats, ids = tiny
    _, floor = _floor(tiny)
    tmp = tmp_path_factory.mktemp("search")
    run = tmp / "run"
    run.mkdir()
    stats.save(run / "stats.safetensors")  # export refits from the run folder's statistics
    cfg = SearchConfig(**_config(tmp, budget_bits=round(floor + 1.0, 3), trials=6))
    doc = search_with(cfg, model, info, stats, ids, run, progress=False)
    return cfg, doc, run


def test_search_outputs_and_constraint(searched):
    from kvcalib.recipe import Recipe

    cfg, doc, run = searched
    for name in ("study.db", "search.json", "pareto.png", "bits_per_layer.png", "report.md", "recipe.safetensors"):
        assert (run / name).is_file(), name
    assert len(doc["trials"]) == 6 and doc["sensitivity"] and len(doc["sensitivity"]) == 2
    assert any(t["warm_start"] for t in doc["trials"])
    rec = Recipe.load(run / "recipe.safetensors")
    chosen = next(t for t in doc["trials"] if t["number"] == doc["chosen"])
    assert chosen["effective_bits"] <= cfg.budget_bits
    feas = [t["kl"] for t in doc["trials"] if t["state"] == "COMPLETE" and t["feasible"]]
    assert chosen["kl"] == min(feas)
    assert abs(rec.memory(rec.model, 256).effective_bits - chosen["effective_bits"]) < 1e-9
    assert rec.provenance["trial"] == doc["chosen"] and rec.provenance["budget_bits"] == cfg.budget_bits
    assert [c.k_bits for c in rec.layers] == chosen["point"]["k_bits"]
    assert doc["presets"][0]["name"] == "kivi-2" and doc["presets"][0]["kl"] > 0
    assert "pareto.png" in (run / "report.md").read_text()
    assert json.loads((run / "search.json").read_text())["chosen"] == doc["chosen"]


def test_export_picks_trial_and_budget(searched, tmp_path):
    from kvcalib.export import export_search_point
    from kvcalib.recipe import Recipe

    cfg, doc, run = searched
    done = [t for t in doc["trials"] if t["state"] == "COMPLETE"]
    other = max(done, key=lambda t: t["effective_bits"])
    rec, record = export_search_point(run, tmp_path / "a.safetensors", trial=other["number"])
    assert record["number"] == other["number"]
    assert [c.v_bits for c in Recipe.load(tmp_path / "a.safetensors").layers] == other["point"]["v_bits"]
    rec, record = export_search_point(run, tmp_path / "b.safetensors", budget_bits=cfg.budget_bits)
    assert record["number"] == doc["chosen"]
    big = max(t["effective_bits"] for t in done)
    rec, record = export_search_point(run, tmp_path / "c.safetensors", budget_bits=big)
    assert record["kl"] == min(t["kl"] for t in done)
    with pytest.raises(KvcalibError, match="no trial 999"):
        export_search_point(run, tmp_path / "d.safetensors", trial=999)
    with pytest.raises(KvcalibError, match="exactly one"):
        export_search_point(run, tmp_path / "d.safetensors")


def test_resume_keeps_trials_and_refuses_without_flag(tiny, searched):
    from kvcalib.optimize import SearchConfig, search_with

    model, info, stats, ids = tiny
    cfg, doc, run = searched
    before = {t["number"]: (t["kl"], t["point"]) for t in doc["trials"]}
    again = SearchConfig(**{**_config(run.parent, budget_bits=cfg.budget_bits, trials=8), "out": run})
    with pytest.raises(KvcalibError, match="--resume"):
        search_with(again, model, info, stats, ids, run, progress=False)
    again.resume = True
    doc2 = search_with(again, model, info, stats, ids, run, progress=False)
    after = {t["number"]: (t["kl"], t["point"]) for t in doc2["trials"]}
    assert len(after) == 8 and all(after[n] == before[n] for n in before)


def test_other_space_same_study_is_refused(tiny, searched):
    from kvcalib.optimize import SearchConfig, search_with

    model, info, stats, ids = tiny
    cfg, doc, run = searched
    n_before = len(doc["trials"])
    other = SearchConfig(**{**_config(run.parent, budget_bits=50.0, trials=9, space={**TINY_SPACE, "sinks": [0]}),
                            "out": run, "resume": True})
    with pytest.raises(KvcalibError, match="another search space"):
        search_with(other, model, info, stats, ids, run, progress=False)
    from kvcalib.optimize.study import open_study
    from kvcalib.optimize.space import SearchSpace

    study = open_study(f"sqlite:///{run / 'study.db'}", "kvcalib-search", SearchSpace.from_dict(TINY_SPACE), 2)
    assert len(study.trials) >= n_before


def test_unreachable_storage(tmp_path):
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.optimize.study import open_study

    space = SearchSpace()
    for url in (f"sqlite:///{tmp_path}/missing/dir/s.db", "postgresql://nobody@127.0.0.1:1/none",
                f"journal:{tmp_path}/nope/j.log", "not a url"):
        with pytest.raises(KvcalibError):
            open_study(url, "s", space, 2)


WORKER = textwrap.dedent("""
    import pathlib, sys, time
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.optimize import study as st
    url, n = sys.argv[1], int(sys.argv[2])
    space = SearchSpace(bits=(2, 4, 8), groups=(32,), windows=(32,), sinks=(0,), layer_methods=())
    study = st.open_study(url, "shared", space, 3, sampler=st.make_sampler(0, 4.0, 2), pruner=st.make_pruner(2))
    # barrier: on a loaded machine one worker can finish every trial before the other has started
    here = pathlib.Path(__file__).parent
    (here / f"ready-{sys.argv[3]}").touch()
    deadline = time.time() + 120
    while len(list(here.glob("ready-*"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    def fn(trial):
        time.sleep(0.05)
        p = space.sample(trial, 3)
        st.set_bits(trial, float(sum(p.k_bits + p.v_bits)) / 6, 4.0)
        trial.set_user_attr("worker", sys.argv[3])
        return float(sum(1.0 / b for b in p.k_bits + p.v_bits))
    st.run_trials(study, fn, n)
""")


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_share_one_study(tmp_path, kind):
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.optimize.study import open_study

    url = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else f"journal:{tmp_path / 's.log'}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    # create the study first (two processes creating one SQLite schema at once can race)
    space = SearchSpace(bits=(2, 4, 8), groups=(32,), windows=(32,), sinks=(0,), layer_methods=())
    open_study(url, "shared", space, 3)
    procs = [subprocess.Popen([sys.executable, str(script), url, "12", name], cwd=str(tmp_path.parent))
             for name in ("a", "b")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    study = open_study(url, "shared", space, 3)
    workers = {t.user_attrs.get("worker") for t in study.trials if t.state.name == "COMPLETE"}
    assert workers == {"a", "b"} and 12 <= len(study.trials) <= 14


@pytest.mark.parametrize("args,match", [
    (["--space", "{space}"], "empty"),
    (["--storage", "postgresql://nobody@127.0.0.1:1/none"], "cannot open study storage"),
    (["--storage", "not a url"], "neither a database URL"),
    (["--budget-bits", "-1"], "positive"),
], ids=["empty-space", "unreachable-postgres", "bad-url", "negative-budget"])
def test_cli_bad_input_exits_2(tmp_path, args, match):
    from typer.testing import CliRunner

    from kvcalib.cli import app

    space = tmp_path / "space.json"
    space.write_text("")
    args = [a.format(space=space) for a in args]
    res = CliRunner().invoke(app, ["search", "--out", str(tmp_path / "run"), *args])
    assert res.exit_code == 2, res.output
    assert match in (res.stderr if hasattr(res, "stderr") else res.output)
    assert not (tmp_path / "run").exists()


def test_check_runs_nothing_and_reports_the_floor(tmp_path):
    """``--check``: the preflight alone, the space's floor beside the budget, nothing written; a
    budget under the floor is the same one-line refusal a real run gives. A byte-saving switch in
    the space lowers the floor (8-bit scale pairs: 2.605 -> 2.361 bits at 8k)."""
    import json

    from typer.testing import CliRunner

    from kvcalib.cli import app

    space = tmp_path / "space.json"
    space.write_text(json.dumps({"bits": [2, 4], "groups": [64], "windows": [64], "sinks": [0],
                                 "layer_methods": ["scale8"]}))
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["search", "--out", str(run), "--context", "8192", "--budget-bits", "2.5",
                                   "--space", str(space), "--check"])
    assert res.exit_code == 0, res.output
    assert "search check passed" in res.output and "the space's floor: 2.36" in res.output and not run.exists()
    res = CliRunner().invoke(app, ["search", "--out", str(run), "--context", "8192", "--budget-bits", "2.5", "--check"])
    assert res.exit_code == 2 and "below the floor of the search space" in res.output and not run.exists()


# ------------------------------------------------------------------ old files, outliers, schedules
OLD_SEARCH = "tests/data/search-v1-before-schedules.json"  # a search.json written before schedules and provenance fields


def test_old_search_json_still_reads():
    import hashlib
    from pathlib import Path

    from kvcalib.optimize.space import Point, SearchSpace
    from kvcalib.optimize.study import choose

    path = Path(__file__).resolve().parents[2] / OLD_SEARCH
    doc = json.loads(path.read_text())
    space = SearchSpace.from_dict(doc["space"])
    assert space.schedules == ("none",)
    # the fingerprint of a space without schedules is the one studies made before them recorded
    old = json.dumps({"space": doc["space"], "num_layers": 30}, sort_keys=True)
    assert space.fingerprint(30) == hashlib.sha256(old.encode()).hexdigest()[:16]
    rec = choose(doc["trials"], doc["budget_bits"])
    assert rec["number"] == doc["chosen"]
    point = Point.from_dict(rec["point"], space)
    assert point.schedule == "none" and point.to_dict()["k_bits"] == rec["point"]["k_bits"]
    from kvcalib.optimize import search_provenance

    prov = search_provenance(doc, rec)  # what `kvcalib export --trial` writes from an old run
    assert prov["storage"] == "sqlite:///study.db" and prov["run"] is None and prov["schedule"] == "none"


def test_schedule_scoring_length_rule():
    from kvcalib.methods.schedule import Schedule, tier_token_counts
    from kvcalib.optimize.space import SearchSpace, SpaceError, check_scored_schedules, min_scoring_length
    from kvcalib.layout import LayerConfig

    space = SearchSpace(sinks=(4,), schedules=("none", "middle-heavy"))
    # 4 sinks + one 64-token key group + age 1024 (the age-4096 tier holds nothing at context 4096)
    with pytest.raises(SpaceError, match=r"age\(s\) \[1024\].*never reach.*--seq-len 1092 .*'ages:188'"):
        check_scored_schedules(space, 256, 4096)
    check_scored_schedules(space, 1092, 4096)
    check_scored_schedules(SearchSpace(), 16, 4096)  # no schedule: nothing to check
    # an age the accounting context never reaches changes nothing counted: accepted
    check_scored_schedules(SearchSpace(schedules=("ages:8192",)), 256, 4096)
    # the rule is exact: at need - 1 tokens some layout's last counted tier is empty, at need it is not
    small = SearchSpace(bits=(8,), groups=(16,), windows=(32,), sinks=(0, 2), schedules=("ages:40,80",))
    need = min_scoring_length(small, 512)
    assert need == 2 + 16 + 80
    cfg = LayerConfig(k_bits=8, v_bits=8, k_group=16, v_group=16, sinks=2, window=32)
    sched = Schedule.from_layer(cfg, (40, 80))
    assert tier_token_counts(sched, need, 16)["tiers"][-1] > 0
    assert tier_token_counts(sched, need - 1, 16)["tiers"][-1] == 0
    with pytest.raises(SpaceError, match="ages:"):
        check_scored_schedules(small, need - 1, 512)


def test_search_config_refuses_unscored_schedule(tmp_path):
    from kvcalib.optimize import SearchConfig

    with pytest.raises(KvcalibError, match="never scored"):
        SearchConfig(out=tmp_path / "run", seq_len=256, space={"sinks": [4], "schedules": ["none", "middle-heavy"]})
    SearchConfig(out=tmp_path / "run", seq_len=1092, space={"sinks": [4], "schedules": ["none", "middle-heavy"]})


def test_space_samples_outliers_and_schedule():
    import optuna

    from kvcalib.optimize.space import Point, SearchSpace, point_params

    space = SearchSpace(groups=(8,), windows=(16,), sinks=(0,), layer_methods=("clip", "outliers"),
                        schedules=("none", "ages:64"))
    assert space.layer_methods == ("clip", "outliers") and space.searches_schedule
    p = Point(8, 16, 0, (2, 4), (8, 2), (("outliers",), ("clip", "outliers")), "channel", "ages:64")
    params = point_params(p, space)
    assert params["schedule"] == "ages:64" and params["outliers1"] is True and params["clip0"] is False
    assert space.sample(optuna.trial.FixedTrial(params), 2) == p
    assert Point.from_params(params, space, 2) == p
    assert Point.from_dict(p.to_dict(), space) == p
    # the default space samples neither (its parameters are those of studies made before them)
    assert "schedule" not in point_params(SearchSpace().floor_point(2), SearchSpace())


def test_objective_fits_outlier_pool_and_schedule(tiny):
    from kvcalib.methods.schedule import Schedule
    from kvcalib.optimize.space import Point

    obj, _ = _floor(tiny)
    p = Point(8, 8, 0, (2, 4), (2, 4), (("outliers", "clip"), ()), "channel", "ages:16,24")
    t = obj.fitted_tensors(p)
    assert t["layers.0.kv.outlier_pool"].dtype == torch.int64 and "layers.1.kv.outlier_pool" not in t
    assert "layers.0.k.clip" in t and "layers.1.k.clip" not in t
    for i, cfg in enumerate(p.layer_configs()):
        assert torch.equal(t[f"layers.{i}.kv.schedule"], Schedule.from_layer(cfg, (16, 24)).to_tensor())
    layer_only = obj.fitted_tensors(p, sides=False)
    assert "layers.0.k.clip" not in layer_only and "layers.0.kv.outlier_pool" in layer_only
    assert obj.fitted_tensors(p)["layers.0.kv.outlier_pool"] is t["layers.0.kv.outlier_pool"]  # cached
    # without statistics (the floor check before collection) the schedule is the same static tiers
    from kvcalib.optimize.objective import SearchObjective

    model, info, _, ids = tiny
    bare = SearchObjective(model, info, None, ids, context=256)
    q = Point(8, 8, 0, (2, 4), (2, 4), ((), ()), "channel", "ages:16,24")
    assert torch.equal(bare.fitted_tensors(q)["layers.1.kv.schedule"], t["layers.1.kv.schedule"])


def _interrupt_after(monkeypatch, n_calls: int):
    """Make the n-th trial's KL computation (``SearchObjective.parts``, what a trial calls) raise
    KeyboardInterrupt (Ctrl-C in the middle of a trial)."""
    from kvcalib.optimize.objective import SearchObjective

    real = SearchObjective.parts
    calls = {"n": 0}

    def parts(self, point, sequences=None, report=None):
        calls["n"] += 1
        if calls["n"] == n_calls:
            raise KeyboardInterrupt
        return real(self, point, sequences, report)

    monkeypatch.setattr(SearchObjective, "parts", parts)
    return calls


def test_interrupted_search_resumes_and_retries_the_stale_trials(tiny, tmp_path, monkeypatch):
    import optuna

    from kvcalib.optimize import SearchConfig, search_with
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.optimize.study import ATTR_RECOVERED, open_study

    model, info, stats, ids = tiny
    _, floor = _floor(tiny)
    run = tmp_path / "run"
    run.mkdir()
    # 3 trials: the interrupt leaves 1 finished, 1 FAIL, then a killed RUNNING one and warm-start
    # points still waiting; the resume has exactly 2 trials left, which must go to the 2 retries
    cfg = SearchConfig(**_config(tmp_path, budget_bits=round(floor + 1.0, 3), trials=3))
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        search_with(cfg, model, info, stats, ids, run, progress=False)
    monkeypatch.undo()
    url, space = f"sqlite:///{run / 'study.db'}", SearchSpace.from_dict(TINY_SPACE)
    study = open_study(url, "kvcalib-search", space, 2)
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs.get("interrupted") and failed[0].params
    finished_before = {t.number: t.params for t in study.trials if t.state.is_finished() and t.state.name != "FAIL"}
    assert len(finished_before) == 1
    # a killed process leaves its trial RUNNING, with its parameters sampled (here the next
    # enqueued warm-start point)
    killed = study.ask()
    space.sample(killed, 2)
    assert killed.params
    assert any(t.state.name == "WAITING" for t in study.trials)  # warm-start points queued before the retries

    cfg.resume = True
    doc = search_with(cfg, model, info, stats, ids, run, progress=False)
    study = open_study(url, "kvcalib-search", space, 2)
    by_num = {t.number: t for t in study.trials}
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") + states.count("PRUNED") == 3  # the same number as an uninterrupted run
    assert sorted(doc["recovered"]) == sorted([failed[0].number, killed.number])
    assert by_num[killed.number].state.name == "FAIL"
    for stale in (failed[0].number, killed.number):
        retry = [t for t in study.trials if t.user_attrs.get(ATTR_RECOVERED) == stale]
        assert len(retry) == 1 and retry[0].state.name in ("COMPLETE", "PRUNED")
        assert retry[0].params == by_num[stale].params
    assert all(by_num[n].params == p for n, p in finished_before.items())  # nothing finished was lost
    # the points that were waiting still wait, behind the retries, for a later --resume with more trials
    requeued = [t for t in study.trials if t.user_attrs.get("requeued")]
    assert requeued and all(t.state.name == "FAIL" for t in requeued)
    assert not {t.number for t in requeued} & {r["number"] for r in doc["trials"]}  # never ran: not recorded
    waiting = [t.system_attrs["fixed_params"] for t in study.trials if t.state.name == "WAITING"]
    assert waiting[:len(requeued)] == [t.system_attrs["fixed_params"] for t in requeued]  # then local moves
    assert "interrupted trial(s) retried" in (run / "report.md").read_text()
    # a second resume retries nothing again
    from kvcalib.optimize.study import recover_interrupted

    assert recover_interrupted(study) == []


def test_failed_retry_is_not_retried_forever(tmp_path):
    import optuna

    from kvcalib.optimize.study import ATTR_RECOVERED, recover_interrupted, tag_failures

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")

    def broken(trial):
        trial.suggest_categorical("x", [1, 2])
        raise RuntimeError("this point always fails")

    with pytest.raises(RuntimeError):
        study.optimize(tag_failures(broken), n_trials=1)
    assert recover_interrupted(study) == [0]
    with pytest.raises(RuntimeError):
        study.optimize(tag_failures(broken), n_trials=1)
    assert study.trials[1].user_attrs[ATTR_RECOVERED] == 0 and "always fails" in study.trials[1].user_attrs["error"]
    assert study.trials[1].params == study.trials[0].params
    assert recover_interrupted(study) == []  # the retry failed by itself: the point is the problem


# ------------------------------------------------------------------ progress and provenance
def test_progress_line_counts_this_session_only():
    from types import SimpleNamespace

    from kvcalib.optimize import TrialProgress

    now = [100.0]
    line = TrialProgress(total=10, budget=3.0, done_at_start=4, clock=lambda: now[0])
    trials = [SimpleNamespace(number=0, values=[0.5], user_attrs={"effective_bits": 2.9}),
              SimpleNamespace(number=1, values=[0.1], user_attrs={"effective_bits": 3.5}),  # over budget
              SimpleNamespace(number=2, values=None, user_attrs={"effective_bits": 2.0})]
    assert line.seconds_left() is None
    now[0] = 120.0
    text = line.update(6, trials)  # 2 trials in 20 s here; the 4 resumed ones do not count
    assert line.seconds_left() == pytest.approx(40.0)
    assert "best KL at <= 3 bits: 0.5 (trial 0, 2.900 bits)" in text and "~40 s left" in text
    capped = TrialProgress(total=10, budget=3.0, done_at_start=0, timeout=30.0, clock=lambda: now[0])
    now[0] = 130.0
    capped.update(1, [])
    assert capped.seconds_left() == pytest.approx(20.0)
    assert "best KL at <= 3 bits: - |" in capped.update(1, [])


def test_provenance_paths(tmp_path):
    from kvcalib.optimize.provenance import command_line, describe_storage, display_path

    cwd = tmp_path / "work"
    assert display_path(cwd / "artifacts" / "runs" / "x", cwd) == "artifacts/runs/x"
    assert display_path("artifacts/runs/x", cwd) == "artifacts/runs/x"
    assert display_path("/tmp/kvs_demo3", cwd) == "kvs_demo3"
    assert display_path(cwd / ".." / "other" / "run", cwd) == "run"
    assert describe_storage(None) == "study.db"
    assert describe_storage("sqlite:////tmp/kvs/study.db", cwd=cwd) == "sqlite:///study.db"
    assert describe_storage(f"journal:{cwd}/j/s.log", cwd=cwd) == "journal:j/s.log"
    assert describe_storage("postgresql://bob:secret@db:5432/optuna") == "postgresql://bob:***@db:5432/optuna"
    line = command_line(["/x/.venv/bin/kvcalib", "search", "--out", "/tmp/kvs_demo3", "--budget-bits", "3",
                         "--storage=sqlite:////tmp/s/study.db", "--study", "my study"], cwd)
    assert line == "kvcalib search --out kvs_demo3 --budget-bits 3 --storage=sqlite:///study.db --study 'my study'"


def test_outputs_hold_no_machine_paths(searched):
    from kvcalib.recipe import Recipe

    cfg, doc, run = searched
    base = str(run.parent)
    assert base not in (run / "search.json").read_text()
    assert base not in (run / "report.md").read_text()
    prov = Recipe.load(run / "recipe.safetensors").provenance
    assert base not in json.dumps(prov)
    assert prov["run"] == "run" and prov["storage"] == "study.db"
    assert "[`study.db`](study.db)" in (run / "report.md").read_text()


def test_search_with_outliers_and_schedule(tiny, tmp_path):
    """The objective scores what the switches change (KL and bits), and a search over them
    writes a recipe carrying their tensors."""
    from kvcalib.optimize import SearchConfig, search_with
    from kvcalib.optimize.space import Point
    from kvcalib.recipe import Recipe

    model, info, stats, ids = tiny
    obj, floor = _floor(tiny)
    plain = Point(8, 8, 0, (8, 8), (8, 8), ((), ()), "channel", "none")
    sched = Point(8, 8, 0, (8, 8), (8, 8), ((), ()), "channel", "ages:12,20")
    assert obj.effective_bits(sched) < obj.effective_bits(plain)  # older blocks at 4 then 2 bits
    assert obj.kl(sched) > obj.kl(plain)  # ... and the scored sequences (40 tokens) see them
    pooled = Point(8, 8, 0, (2, 2), (2, 2), (("outliers",), ("outliers",)), "channel", "none")
    assert obj.effective_bits(pooled) > obj.effective_bits(Point(8, 8, 0, (2, 2), (2, 2), ((), ())))  # pools counted
    space = {**TINY_SPACE, "layer_methods": ["clip", "outliers"], "schedules": ["none", "ages:20"]}
    cfg = SearchConfig(**_config(tmp_path, budget_bits=round(floor + 2.0, 3), trials=5, space=space, seq_len=40))
    run = tmp_path / "run"
    run.mkdir()
    doc = search_with(cfg, model, info, stats, ids, run, progress=False)
    points = [t["point"] for t in doc["trials"] if t["point"]]
    assert {p["schedule"] for p in points} <= {"none", "ages:20"}
    assert any("outliers" in m for p in points for m in p["methods"])
    chosen = next(t for t in doc["trials"] if t["number"] == doc["chosen"])
    rec = Recipe.load(run / "recipe.safetensors")
    has_pool = any(k.endswith("kv.outlier_pool") for k in rec.tensors)
    assert has_pool == any("outliers" in m for m in chosen["point"]["methods"])
    assert any(k.endswith("kv.schedule") for k in rec.tensors) == (chosen["point"]["schedule"] != "none")


def test_a_study_seen_before_its_attributes_are_written_is_awaited(tmp_path, monkeypatch):
    """Two workers starting at once: one has created the shared study but not yet written its
    space fingerprint (Optuna writes attributes after the study) when the other opens it. The
    second waits for the fingerprint instead of refusing the study as another space's; a study
    that never gets one (made outside kvcalib) is still refused, after the wait."""
    import threading
    import time

    import optuna

    from kvcalib.layout import ACCOUNTING
    from kvcalib.optimize import study as study_mod
    from kvcalib.optimize.space import SearchSpace

    space = SearchSpace.from_dict(TINY_SPACE)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    bare = optuna.create_study(storage=url, study_name="shared")  # the first worker, attributes not yet written

    def first_worker_finishes_creating():
        time.sleep(0.6)
        bare.set_user_attr(study_mod.ATTR_ACCOUNTING, ACCOUNTING)
        bare.set_user_attr(study_mod.ATTR_SPACE, space.fingerprint(2))

    writer = threading.Thread(target=first_worker_finishes_creating)
    writer.start()
    opened = study_mod.open_study(url, "shared", space, 2)
    writer.join()
    assert opened.user_attrs[study_mod.ATTR_SPACE] == space.fingerprint(2)

    optuna.create_study(storage=url, study_name="foreign")
    monkeypatch.setattr(study_mod, "FINGERPRINT_WAIT", 0.5)
    t0 = time.monotonic()
    with pytest.raises(KvcalibError, match="another search space"):
        study_mod.open_study(url, "foreign", space, 2)
    assert time.monotonic() - t0 >= 0.5


def test_warm_start_tries_each_method_alone_and_the_most_sinks():
    """The warm start must show the sampler each switch on every layer by itself, and the sinks
    (on SmolLM2 at 8k, clipping everywhere hid rotation's gain, and sinks were found late)."""
    from types import SimpleNamespace

    from kvcalib.optimize.space import SearchSpace
    from kvcalib.optimize.study import warm_start_points

    class Bits:  # effective bits: the mean of the layers' K and V bits, plus what sinks cost
        info = SimpleNamespace(num_layers=4)

        def effective_bits(self, point, with_tensors=None):
            return (sum(point.k_bits) + sum(point.v_bits)) / (2 * len(point.k_bits)) + 0.01 * point.sinks

    space = SearchSpace(bits=(2, 4, 8), groups=(32,), windows=(64,), sinks=(0, 4), layer_methods=("clip", "rotate"))
    points = warm_start_points(Bits(), space, [1.0, 2.0, 3.0, 4.0], budget=3.0)
    at_budget = [p for p in points if Bits().effective_bits(p) > 2.5 and Bits().effective_bits(p) <= 3.0]
    uniform = {(p.methods[0], p.sinks) for p in at_budget if len(set(p.methods)) == 1}
    for methods in [("rotate", "clip"), (), ("rotate",), ("clip",)]:
        assert {(methods, 0), (methods, 4)} <= uniform, (methods, sorted(uniform))
    assert len(points) == len(set(points))
    one = SearchSpace(bits=(2, 4, 8), groups=(32,), windows=(64,), sinks=(4,), layer_methods=("clip",))
    assert {p.methods[0] for p in warm_start_points(Bits(), one, [1.0] * 4, budget=3.0)} == {("clip",), ()}

    class CostlySinks(Bits):  # 4 sinks alone overflow the budget (a partial group left in full precision)
        def effective_bits(self, point, with_tensors=None):
            return super().effective_bits(point) + (2.0 if point.sinks else 0.0)

    over = [p for p in warm_start_points(CostlySinks(), space, [1.0] * 4, budget=3.0) if p.sinks]
    assert over == []  # never enqueued: a warm-start trial over the budget is a trial wasted


def test_local_moves_never_enqueue_a_point_over_the_budget():
    """A local move that changes sinks, group or window can leave a point the repair cannot bring
    under the budget; such moves are redrawn, never enqueued (they were 8 of 30 trials of a
    2,048-token search)."""
    from types import SimpleNamespace

    import optuna

    from kvcalib.optimize.space import Point, SearchSpace, point_params
    from kvcalib.optimize.study import make_local_callback

    class Bits:  # mean K/V bits; 4 sinks or group 32 put any point 1 bit higher (a partial group)
        info = SimpleNamespace(num_layers=4)

        def effective_bits(self, point, with_tensors=None):
            mean = (sum(point.k_bits) + sum(point.v_bits)) / (2 * len(point.k_bits))
            return mean + (1.0 if point.sinks or point.group == 32 else 0.0)

    space = SearchSpace(bits=(2, 4, 8), groups=(32, 64), windows=(64,), sinks=(0, 4), layer_methods=("clip",))
    study = optuna.create_study()
    best = Point(64, 64, 0, (4, 2, 2, 2), (2, 2, 2, 2), ((),) * 4)
    params = point_params(best, space)
    dists = {k: optuna.distributions.CategoricalDistribution(
        list(space.bits) if k[0] in "kv" and k[1:].isdigit() else [False, True] if k.startswith("clip")
        else list(getattr(space, k + ("s" if k != "sinks" else "")))) for k in params}
    study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=0.1,
                                              user_attrs={"effective_bits": 2.25}))
    study.set_user_attr("sensitivity", [4.0, 3.0, 2.0, 1.0])
    callback = make_local_callback(Bits(), space, budget=2.6, seed=0, fraction=1.0)
    for number in range(1, 41):
        callback(study, SimpleNamespace(number=number))
    waiting = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.WAITING]
    assert waiting  # moves were made
    for t in waiting:
        point = Point.from_params(t.system_attrs["fixed_params"], space, 4)
        assert Bits().effective_bits(point) <= 2.6, point


def test_a_study_of_the_default_space_before_rotate_is_refused_with_the_space_to_resume_it(tmp_path):
    """rotate joined the default space's switches on 2026-11-26: a study begun with the earlier default
    (clip alone) is refused as another space, and the message names the --space that resumes it."""
    import optuna

    import kvcalib.optimize.study as study_mod
    from kvcalib.optimize.space import SearchSpace

    now = SearchSpace()
    assert now.layer_methods == ("rotate", "clip")
    earlier = SearchSpace(layer_methods=("clip",))
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study_mod.open_study(url, "old", earlier, 30)
    with pytest.raises(KvcalibError, match=r'pass --space with \{"layer_methods": \["clip"\]\}'):
        study_mod.open_study(url, "old", now, 30)
    optuna.load_study(study_name="old", storage=url)  # still there, unchanged
    other = SearchSpace(layer_methods=("clip",), sinks=(0,))
    study_mod.open_study(url, "other", other, 30)
    with pytest.raises(KvcalibError, match="another search space") as err:
        study_mod.open_study(url, "other", now, 30)
    assert "without rotate" not in str(err.value)  # no hint where it would be wrong
