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
from tests.conftest import tiny_model

TINY_SPACE = {"bits": [2, 4, 8], "groups": [8], "windows": [8, 16], "sinks": [0, 2], "layer_methods": ["clip"]}


# ------------------------------------------------------------------ space
def test_default_space_and_files(tmp_path):
    from kvcalib.optimize.space import SearchSpace

    s = SearchSpace()
    assert s.bits == (2, 4, 8) and "clip" in s.layer_methods
    f = tmp_path / "space.yaml"
    f.write_text("bits: [2, 4]\ngroups: [32]\nwindows: [32, 64]\n")
    s2 = SearchSpace.from_file(f)
    assert s2.bits == (2, 4) and s2.fingerprint(30) != s.fingerprint(30)
    assert s.fingerprint(30) == SearchSpace().fingerprint(30)


@pytest.mark.parametrize("text,match", [
    ("", "empty"),
    ("{}", "empty"),
    ('{"bitz": [2]}', "unknown keys"),
    ('{"bits": [3]}', "not allowed"),
    ('{"bits": [16]}', "not allowed"),
    ('{"bits": []}', "empty"),
    ('{"groups": [64], "windows": [32]}', "shorter than group"),
    ('{"layer_methods": ["outliers"]}', "unknown method"),
    ("{not json", "not valid JSON"),
], ids=["empty-file", "empty-object", "unknown-key", "bits-3", "bits-16", "no-bits", "short-window",
        "unapplied-method", "bad-json"])
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
    from kvcalib.collection import collect_stats
    from kvcalib.models import model_info

    model = tiny_model("llama")
    info = model_info(model.config, "tiny-llama")
    g = torch.Generator().manual_seed(0)
    collect_ids = torch.randint(0, 128, (4, 32), generator=g)  # (N, T) statistics
    score_ids = torch.randint(0, 128, (2, 40), generator=g)  # (M, T) held: disjoint draws
    stats = collect_stats(model, collect_ids, reservoir_blocks=4, block_len=16, name="tiny-llama", progress=False)
    return model, info, stats, score_ids


def _config(tmp_path, **kw):
    from kvcalib.optimize import SearchConfig

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
    from kvcalib.recipe import LayerConfig

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
    import sys
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.optimize import study as st
    url, n = sys.argv[1], int(sys.argv[2])
    space = SearchSpace(bits=(2, 4, 8), groups=(32,), windows=(32,), sinks=(0,), layer_methods=())
    study = st.open_study(url, "shared", space, 3, sampler=st.make_sampler(0, 4.0, 2), pruner=st.make_pruner(2))
    def fn(trial):
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
