"""``kvcalib export RUN --trial N|--budget-bits B --rotate KIND``: a searched point refitted with
another rotation kind (the search fits the Hadamard one; a learned fit takes seconds a side, too
slow per trial). The layers the point rotates get the kind's matrices, the budget leaves room for
the most they can add (the search objective's planned side bytes), and the recipe records the refit. Tiny random model, 4 trials."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kvcalib.errors import KvcalibError
from kvcalib.models import model_info
from kvcalib.recipe import Recipe
from tests.conftest import tiny_model

CONTEXT = 128


def rotation_run(tmp_path_factory, name: str):
    """A tiny llama (2 layers, 2 kv heads, head_dim 16), its geometry, statistics, scoring ids
    ``(M, T)`` and a run folder holding the statistics (export refits from them)."""
    from kvcalib.collection import collect_stats

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16)
    info = model_info(model.config, "tiny-llama")
    g = torch.Generator().manual_seed(0)
    stats = collect_stats(model, torch.randint(0, 128, (4, 32), generator=g), reservoir_blocks=4, block_len=16,
                          name="tiny-llama", progress=False)
    ids = torch.randint(0, 128, (2, 40), generator=g)  # (M, T) scoring sequences
    run = tmp_path_factory.mktemp(name) / "run"
    run.mkdir()
    stats.save(run / "stats.safetensors")
    return model, info, stats, ids, run


@pytest.fixture(scope="module")
def rotated_search(tmp_path_factory):
    """A 4-trial search whose space switches the rotation per layer."""
    from kvcalib.optimize import SearchConfig, search_with

    model, info, stats, ids, run = rotation_run(tmp_path_factory, "rot")
    space = {"bits": [2, 4], "groups": [8], "windows": [8], "sinks": [0], "layer_methods": ["rotate"]}
    cfg = SearchConfig(out=run, trials=4, budget_bits=16.0, space=space, eval=False, presets=("fp16",),
                       context=CONTEXT, chosen_methods=(), sweep=False)
    doc = search_with(cfg, model, info, stats, ids, run, progress=False)
    return info, doc, run


def _rotated_trial(doc: dict) -> dict:
    """A complete trial whose point rotates some quantized layer."""
    for t in doc["trials"]:
        if t["state"] == "COMPLETE" and any("rotate" in m for m in t["point"]["methods"]):
            return t
    pytest.fail("no trial of the fixture's search rotates a layer: change its seed")


def _planned(info, point, kind: str | None) -> int:
    """The most bytes the rotations of ``point`` store refitted as ``kind`` (None: the search's own
    Hadamard ones), as the search objective plans them."""
    from kvcalib.methods import registry
    from kvcalib.optimize.objective import SearchObjective

    overrides = {} if kind is None else {"rotate": registry()["rotate"](kind=kind)}
    objective = SearchObjective(None, info, None, torch.zeros(1, 2, dtype=torch.long), context=CONTEXT,
                                method_overrides=overrides)
    return objective.planned_side_bytes(point, only={"rotate"})


def test_a_trial_refitted_with_learned_rotations(rotated_search, tmp_path):
    from kvcalib.export import export_search_point
    from kvcalib.optimize.space import Point, SearchSpace

    info, doc, run = rotated_search
    trial = _rotated_trial(doc)
    plain, _ = export_search_point(run, tmp_path / "h.safetensors", trial=trial["number"])
    learned, record = export_search_point(run, tmp_path / "l.safetensors", trial=trial["number"], rotate="learned")
    rotated_layers = {i for i, m in enumerate(trial["point"]["methods"]) if "rotate" in m}
    assert not any(k.endswith(".rotation") for k in plain.tensors)  # the search's kind: seeds (or nothing)
    matrices = {k: t for k, t in learned.tensors.items() if k.endswith(".rotation")}
    # one (D, D) per side, shared by the heads, only on the layers the point rotates (random weights:
    # there the Hadamard rotation does not pay and the learned one does)
    assert matrices and all(t.shape == (16, 16) for t in matrices.values())
    assert {int(k.split(".")[1]) for k in matrices} <= rotated_layers
    assert learned.layers == plain.layers  # the searched layout, unchanged
    point = Point.from_dict(trial["point"], SearchSpace.from_dict(doc["space"]))
    bound = 8.0 * _planned(info, point, "learned") / learned.memory(info, CONTEXT).elements
    assert record["searched_bits"] == trial["effective_bits"]
    assert trial["effective_bits"] < record["effective_bits"] <= trial["effective_bits"] + bound + 1e-9
    assert Recipe.load(tmp_path / "l.safetensors").provenance["rotate_refit"] == "learned"
    # per quantized side of a rotated layer: the gain (4 bytes) and the larger of the seed (24) and
    # the kind's float32 matrices, (D, D) shared or (H, D, D) per kv head (H = 2, D = 16)
    sides = sum(b < 16 for cfg, m in zip(point.layer_configs(), point.methods) if "rotate" in m
                for b in (cfg.k_bits, cfg.v_bits))
    assert sides and _planned(info, point, "learned") == sides * (4 + 16 * 16 * 4)
    assert _planned(info, point, "learned-head") == sides * (4 + 2 * 16 * 16 * 4)
    assert _planned(info, point, "hadamard") == _planned(info, point, None) == sides * (4 + 24)


def test_the_budget_leaves_room_for_the_matrices(rotated_search, tmp_path):
    from kvcalib.export import export_search_point

    from kvcalib.optimize.study import choose

    info, doc, run = rotated_search
    rotating = [t for t in doc["trials"] if t["state"] == "COMPLETE" and any("rotate" in m for m in t["point"]["methods"])]
    target = min(rotating, key=lambda t: (t["kl"], t["effective_bits"]))
    budget = target["effective_bits"] + 1e-9  # room for this trial's layout, not for its matrices
    assert choose(doc["trials"], budget)["number"] == target["number"]  # the pick without that room
    recipe, record = export_search_point(run, tmp_path / "b.safetensors", budget_bits=budget, rotate="learned-head")
    assert record["number"] != target["number"] and record["effective_bits"] <= budget  # its matrices fit
    with pytest.raises(KvcalibError, match="not a rotation kind"):
        export_search_point(run, tmp_path / "x.safetensors", trial=target["number"], rotate="givens")
    # the command says when the pick under the budget rotates nothing (the better points had no room)
    from kvcalib.cli import app

    res = CliRunner().invoke(app, ["export", str(run), "-o", str(tmp_path / "c.safetensors"), "--budget-bits",
                                   repr(budget), "--rotate", "learned-head"])
    assert res.exit_code == 0, res.output
    rotates = any(k.endswith((".rotation", ".rotate")) for k in recipe.tensors)
    assert ("rotates no layer" in res.output) == (not rotates)


def test_cli_refits_with_rotate_and_still_refuses_other_flags(rotated_search, tmp_path):
    from kvcalib.cli import app

    _, doc, run = rotated_search
    trial = _rotated_trial(doc)
    out = tmp_path / "cli.safetensors"
    res = CliRunner().invoke(app, ["export", str(run), "-o", str(out), "--trial", str(trial["number"]),
                                   "--rotate", "learned"])
    assert res.exit_code == 0, res.output
    assert "rotations refitted as learned" in res.output and out.is_file()
    res = CliRunner().invoke(app, ["export", str(run), "-o", str(tmp_path / "c2.safetensors"), "--trial",
                                   str(trial["number"]), "--rotate", "learned", "--clip"])
    assert res.exit_code == 2 and "only --rotate may refit" in res.output


def test_a_point_that_rebuilds_at_other_bits_names_the_cause(rotated_search, tmp_path):
    """Statistics other than the search's (or another accounting) rebuild a trial at other bits:
    refused with the cause and the fixes, and --rotate hadamard refits it deliberately."""
    import json
    import shutil

    from kvcalib.export import export_search_point

    _, doc, run = rotated_search
    other = tmp_path / "other"
    shutil.copytree(run, other)
    tampered = json.loads((run / "search.json").read_text())
    trial = tampered["trials"][0]
    trial["effective_bits"] += 0.01  # as if the search had fitted other statistics
    (other / "search.json").write_text(json.dumps(tampered))
    with pytest.raises(KvcalibError, match="not the ones the search fitted.*--rotate hadamard"):
        export_search_point(other, tmp_path / "r.safetensors", trial=trial["number"])
    assert not (tmp_path / "r.safetensors").exists()
    recipe, record = export_search_point(other, tmp_path / "r.safetensors", trial=trial["number"], rotate="hadamard")
    assert record["searched_bits"] == pytest.approx(trial["effective_bits"]) != record["effective_bits"]
