"""``kvcalib search --rotate KIND``: the space's rotate switch fits KIND (the objective's
``method_overrides``, built as export builds them), the trials' bits count what it stores, the run
records it, and ``kvcalib export RUN --trial N`` rebuilds a trial with it unasked. Tiny random
model (2 layers, 2 kv heads, head_dim 16), one 6-trial search."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvcalib.errors import KvcalibError
from kvcalib.recipe import Recipe
from tests.unit.test_export_rotate import rotation_run

CONTEXT = 128
BUDGET = 9.1  # binds: on this fixture a trial rotating both layers with 4-bit values takes 9.102 bits
SPACE = {"bits": [2, 4], "groups": [8], "windows": [8], "sinks": [0], "layer_methods": ["rotate"]}


def _config(run, **kw):
    from kvcalib.optimize import SearchConfig

    base = dict(out=run, trials=6, budget_bits=BUDGET, space=dict(SPACE), eval=False, presets=("fp16",),
                context=CONTEXT, chosen_methods=(), sweep=False, rotate="learned")
    return SearchConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def learned_search(tmp_path_factory):
    from kvcalib.optimize import search_with

    model, info, stats, ids, run = rotation_run(tmp_path_factory, "learned")
    doc = search_with(_config(run), model, info, stats, ids, run, progress=False)
    return (model, info, stats, ids), doc, run


def test_the_search_fits_learned_matrices_and_pays_for_them(learned_search):
    (_, info, _, _), doc, run = learned_search
    assert doc["config"]["rotate"] == "learned"
    chosen = next(t for t in doc["trials"] if t["number"] == doc["chosen"])
    rotated = {i for i, m in enumerate(chosen["point"]["methods"]) if "rotate" in m}
    assert rotated, "the fixture's pick rotates no layer: change its seed"
    recipe = Recipe.load(run / "recipe.safetensors")
    matrices = {k: t for k, t in recipe.tensors.items() if k.endswith(".rotation")}
    # one (D, D) matrix per side, shared by the kv heads, only where the point rotates
    assert matrices and all(t.shape == (16, 16) and t.dtype == torch.float32 for t in matrices.values())
    assert {int(k.split(".")[1]) for k in matrices} <= rotated
    assert recipe.provenance["rotate"] == "learned"
    # every tensor counted: the recipe's bits are the trial's, within the budget (so is every feasible trial's)
    bits = recipe.memory(info, CONTEXT).effective_bits
    assert bits == pytest.approx(chosen["effective_bits"], abs=1e-9) and bits <= BUDGET
    assert any(t["effective_bits"] > BUDGET for t in doc["trials"] if t["state"] == "COMPLETE")  # the budget binds
    assert "`learned` rotations (`--rotate learned`" in (run / "report.md").read_text()


def test_export_rebuilds_the_trial_with_the_searched_kind(learned_search, tmp_path):
    from kvcalib.cli import app

    _, doc, run = learned_search
    searched = Recipe.load(run / "recipe.safetensors")
    out = tmp_path / "again.safetensors"
    res = CliRunner().invoke(app, ["export", str(run), "-o", str(out), "--trial", str(doc["chosen"])])
    assert res.exit_code == 0, res.output
    assert "learned rotations as searched" in res.output
    again = Recipe.load(out)
    assert again.tensors.keys() == searched.tensors.keys()
    assert all(torch.equal(again.tensors[k], searched.tensors[k]) for k in searched.tensors)  # bit for bit
    assert "rotate_refit" not in again.provenance and again.provenance["rotate"] == "learned"
    # an explicit --rotate still wins: the same point with Hadamard seeds
    res = CliRunner().invoke(app, ["export", str(run), "-o", str(tmp_path / "h.safetensors"), "--trial",
                                   str(doc["chosen"]), "--rotate", "hadamard"])
    assert res.exit_code == 0, res.output
    hadamard = Recipe.load(tmp_path / "h.safetensors")
    assert not any(k.endswith(".rotation") for k in hadamard.tensors) and hadamard.layers == searched.layers


def test_workers_and_resumes_get_the_same_kind(learned_search):
    from kvcalib.optimize.objective import rotation_overrides
    from kvcalib.optimize.workers import config_from_json, config_to_json

    (model, info, stats, ids), _, run = learned_search
    worker = config_from_json(json.loads(json.dumps(config_to_json(_config(run)))))  # what a worker process reads
    assert worker.rotate == "learned" and rotation_overrides(worker.rotate)["rotate"].kind == "learned"
    assert rotation_overrides("hadamard") == {} and rotation_overrides(None) == {}  # the default search: unchanged
    from kvcalib.optimize import search_with

    with pytest.raises(KvcalibError, match="--rotate hadamard differs from the study.*--rotate learned"):
        search_with(_config(run, rotate="hadamard", resume=True, trials=7), model, info, stats, ids, run,
                    progress=False)
    from kvcalib.optimize.guards import check_same_objective, objective_record

    before = {k: v for k, v in objective_record(_config(run)).items() if k != "rotate"}  # a study from before --rotate
    with pytest.raises(KvcalibError, match="--rotate learned differs .* made with --rotate hadamard"):
        check_same_objective(before, _config(run), "r")


@pytest.mark.parametrize("args,match", [
    (["--rotate", "givens"], "--rotate 'givens' is not a rotation kind: use one of hadamard, pca, learned"),
    (["--rotate", "learned", "--space", "{space}"], "--rotate learned: the search space switches no rotation"),
], ids=["unknown-kind", "space-without-rotate"])
def test_cli_refuses_a_bad_rotate_in_one_line(tmp_path, args, match):
    from kvcalib.cli import app

    space = tmp_path / "space.json"
    space.write_text(json.dumps({**SPACE, "layer_methods": ["clip"]}))
    res = CliRunner().invoke(app, ["search", "--out", str(tmp_path / "run"), *[a.format(space=space) for a in args]])
    assert res.exit_code == 2, res.output
    assert match in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "run").exists()


def test_cli_flag_reaches_the_search(tmp_path, monkeypatch):
    """``--rotate`` is the config the search (and each worker, :func:`config_to_json`) runs with."""
    import kvcalib.optimize.workers as workers
    from kvcalib.cli import app

    seen = {}

    def stop(config):
        seen["rotate"] = config.rotate
        raise KvcalibError("stopped before the model loads")

    monkeypatch.setattr(workers, "search_any", stop)
    res = CliRunner().invoke(app, ["search", "--out", str(tmp_path / "run"), "--rotate", "learned-head"])
    assert res.exit_code == 2 and "stopped before" in res.output, res.output
    assert seen == {"rotate": "learned-head"}


def test_a_search_json_with_an_unknown_kind_is_refused_in_one_line(learned_search, tmp_path):
    import shutil

    from kvcalib.export import export_search_point

    _, doc, run = learned_search
    other = tmp_path / "other"
    shutil.copytree(run, other)
    tampered = json.loads((run / "search.json").read_text())
    tampered["config"]["rotate"] = "givens"
    (other / "search.json").write_text(json.dumps(tampered))
    with pytest.raises(KvcalibError, match="config.rotate is 'givens'.*not a rotation kind.*Restore the file"):
        export_search_point(other, tmp_path / "x.safetensors", trial=doc["chosen"])
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("device,layer_methods,expected", [
    ("cuda", ["rotate"], "learned"),  # a GPU search fits the rotations (the shipped defaults' kind)
    ("cpu", ["rotate"], "hadamard"),  # a CPU search keeps the seed: the fits would cost minutes there
    ("cuda", ["clip"], "hadamard"),  # a space without the switch fits no rotation, and is not refused
    (None, ["rotate"], None),  # no --device: the device the model will load on (default_device)
], ids=["gpu", "cpu", "gpu-no-rotate-switch", "default-device"])
def test_auto_rotation_follows_the_device(tmp_path, device, layer_methods, expected):
    """``--rotate auto``, the default, resolves when the config is made, so the run records (and a
    resumed study checks) the kind it fits."""
    from kvcalib.models import default_device
    from kvcalib.optimize import SearchConfig

    config = SearchConfig(out=tmp_path / "run", space={**SPACE, "layer_methods": layer_methods}, device=device)
    if expected is None:
        expected = "learned" if default_device() == "cuda" else "hadamard"
    assert config.rotate == expected
    assert SearchConfig(out=tmp_path / "run", space=dict(SPACE), device=device, rotate="pca").rotate == "pca"
