"""`kvcalib inspect`: provenance shown, and `--diff` comparing two recipes layer by layer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from kvcalib.cli import app
from kvcalib.inspect import diff_recipes, inspect_recipe, provenance_summary
from kvcalib.models import model_info
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from tests.conftest import tiny_config


def _recipes(tmp_path):
    info = model_info(tiny_config("llama", layers=4), "tiny")
    base = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=16)
    a = Recipe(name="a", layers=[base] * 4, model=info, provenance={
        "made_by": "kvcalib search", "data": "embedded", "samples": 8, "objective": "kl",
        "objective_value": 0.0123, "n_trials": 40, "held_out_ppl": 21.5})
    layers_b = [base, LayerConfig(k_bits=4, v_bits=2, k_group=8, v_group=8, window=16), base,
                LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=32, sinks=4)]
    b = Recipe(name="b", layers=layers_b, model=info,
               tensors={"layers.2.k.clip": torch.ones(2, 16)}, provenance={"made_by": "kvcalib export", "data": "embedded"})
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.save(pa)
    b.save(pb)
    return str(pa), str(pb)


def test_diff_shows_only_differing_layers(tmp_path):
    pa, pb = _recipes(tmp_path)
    d = diff_recipes(pa, pb)
    assert [r["layer"] for r in d["layers"]] == [1, 2, 3]
    by = {r["layer"]: r for r in d["layers"]}
    assert by[1]["changes"] == {"k_bits": [2, 4]}
    assert by[1]["effective_bits"][1] > by[1]["effective_bits"][0]
    assert by[2]["changes"] == {"fitted": [[], ["k.clip"]]}
    assert by[3]["changes"] == {"window": [16, 32], "sinks": [0, 4]}
    s = d["summary"]
    assert s["differing_layers"] == 3 and s["identical_layers"] == 1
    assert s["fields"] == {"k_bits": 1, "fitted": 1, "window": 1, "sinks": 1}
    assert s["effective_bits_delta"] == d["b"]["effective_bits"] - d["a"]["effective_bits"]
    assert "made_by" in s["provenance_differs"] and "data" not in s["provenance_differs"]
    same = diff_recipes(pa, pa)
    assert same["layers"] == [] and same["summary"]["differing_layers"] == 0


def test_diff_of_presets_uses_model_geometry():
    d = diff_recipes("kivi-2", "kivi-4", model="smollm2-135m")
    assert d["summary"]["differing_layers"] == d["num_layers"] == 30
    assert d["summary"]["fields"] == {"k_bits": 30, "v_bits": 30}


def test_provenance_summary_orders_known_keys_and_keeps_the_rest():
    got = provenance_summary({"zz": 1, "samples": 8, "data": "embedded", "objective_value": 0.123456789,
                              "empty": None})
    assert got == [("data", "embedded"), ("samples", "8"), ("objective value", "0.123457"), ("zz", "1")]


def test_inspect_report_and_cli_show_origin(tmp_path):
    pa, pb = _recipes(tmp_path)
    report = inspect_recipe(pa)
    assert ("objective", "kl") in [tuple(x) for x in report["origin"]]
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", pa])
    assert res.exit_code == 0, res.output
    assert "made from:" in res.output and "held-out ppl: 21.5" in res.output and "trials: 40" in res.output
    res = runner.invoke(app, ["inspect", pa, "--diff", pb])
    assert res.exit_code == 0, res.output
    assert "3 of 4 layers differ" in res.output and "k.clip" in res.output and "2 -> 4" in res.output
    res = runner.invoke(app, ["inspect", pa, "--diff", pb, "--json"])
    assert json.loads(res.output)["summary"]["differing_layers"] == 3
    res = runner.invoke(app, ["inspect", pa, "--diff", str(tmp_path / "missing.safetensors")])
    assert res.exit_code == 2 and "does not exist" in res.output


def _coded_recipe(tmp_path, store_histograms=False, corrupt=False):
    from tests.unit.test_codebooks import CONFIGS, _recipe, _stats

    from kvcalib.methods.huffman import add_codebooks

    rec = add_codebooks(_recipe(), _stats(), store_histograms=store_histograms, only_if_smaller=False)
    if corrupt:
        rec.tensors["layers.0.v.huffman"] = torch.ones(16, dtype=torch.uint8)  # Kraft sum 8 > 1
    path = tmp_path / "coded.safetensors"
    rec.save(path)
    return str(path), rec, CONFIGS


def test_inspect_shows_huffman_bits_and_coded_effective_bits(tmp_path):
    import pytest

    from kvcalib.methods.huffman import codebook_bits, entropy_memory
    from kvcalib.errors import RecipeError
    from kvcalib.inspect import method_lines as huffman_lines

    path, rec, configs = _coded_recipe(tmp_path)
    report = inspect_recipe(path, context=512)
    h = report["huffman"]
    bits, source = codebook_bits(rec, configs)
    mem = entropy_memory(rec, rec.model, bits, 512)
    assert h["estimate"] == source and h["coded_sides"] == h["quantized_sides"] == 3
    assert h["effective_bits"] == mem.coded.effective_bits and h["uncoded_effective_bits"] == mem.uncoded.effective_bits
    rows = {r["layer"]: r for r in report["layers"]}
    assert rows[1]["k_huffman_bits"] is None and rows[1]["v_huffman_bits"] == bits[(1, "v")]
    # per-layer coded bits add up to the whole (the recipe's tensors, like the uncoded per-layer
    # column's, are counted only in the total; the centering means are a layer's)
    per_layer = sum(r["coded_effective_bits"] for r in report["layers"]) / len(rows)
    c = mem.coded.components
    rest = 8 * c["recipe_state"] / mem.coded.elements
    assert per_layer + rest == pytest.approx(h["effective_bits"])
    lines = huffman_lines(report)
    assert "Huffman-coded effective bits at 512" in lines[0] and "1: -|" in lines[1]
    assert any(label == "huffman" and "max_len 12" in value for label, value in report["origin"])
    res = CliRunner().invoke(app, ["inspect", path, "--json", "--context", "512"])
    assert res.exit_code == 0 and json.loads(res.output)["huffman"]["coded_sides"] == 3
    hist_path, _, _ = _coded_recipe(tmp_path / "h", store_histograms=True)
    assert inspect_recipe(hist_path)["huffman"]["estimate"] == "calibration histogram"
    bad_path, _, _ = _coded_recipe(tmp_path / "bad", corrupt=True)
    with pytest.raises(RecipeError, match="layers.0.v.huffman"):
        inspect_recipe(bad_path)


def test_inspect_without_codebooks_has_no_huffman_section(tmp_path):
    from kvcalib.inspect import method_lines as huffman_lines

    pa, _ = _recipes(tmp_path)
    report = inspect_recipe(pa)
    assert report["huffman"] is None and huffman_lines(report) == []
    assert "k_huffman_bits" not in report["layers"][0]


def test_inspect_defaults_to_the_context_the_recipe_was_searched_for():
    """A recipe searched for 16k tokens is shown at 16k unless --context says otherwise (its bits
    at 4096 are another number: the window and sinks are a larger share of a shorter cache)."""
    path = str(Path(__file__).resolve().parents[2] / "recipes" / "qwen2.5-coder-0.5b" / "long-16384-3.0b"
               / "recipe.safetensors")
    searched = inspect_recipe(path)
    assert searched["context"] == 16384
    assert abs(searched["memory"]["effective_bits"] - 2.978) < 0.01  # what its search reported at 16k
    assert inspect_recipe(path, context=4096)["memory"]["effective_bits"] > searched["memory"]["effective_bits"]
    assert inspect_recipe("kivi-2")["context"] == 4096  # a preset records no context
    res = CliRunner().invoke(app, ["inspect", path])
    assert res.exit_code == 0 and "(context 16384)" in res.stdout


def test_a_context_beyond_the_models_positions_is_refused():
    """An explicit --context the model cannot hold is one line naming the limit (the accounting of
    2**40 tokens would not finish), for a report and for a diff."""
    import pytest

    from kvcalib.errors import KvcalibError

    with pytest.raises(KvcalibError, match="beyond smollm2-135m's 8,192 positions: pass --context 8192 or less"):
        inspect_recipe("kivi-2", context=2 ** 40)
    with pytest.raises(KvcalibError, match="beyond smollm2-135m's 8,192 positions"):
        diff_recipes("kivi-2", "kivi-4", context=10_000)
    assert inspect_recipe("kivi-2", context=8192)["context"] == 8192
