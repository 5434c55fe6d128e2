"""experiments/recipe_kl.py: a recipe with fitted codecs (here a Hadamard rotation on both sides)
through the hooked attention gives the decode-faithful simulation's logits, and a run writes a row
per recipe."""

from __future__ import annotations

import pytest
import torch

from experiments import head_sensitivity as hs
from experiments import recipe_kl as rk
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from tests.conftest import corpus_lines, tiny_loaded_model
from tests.unit.test_head_sensitivity import LAST, T, _ids

LAYOUT = dict(k_bits=2, v_bits=3, k_group=16, v_group=16, sinks=2, window=16)


@pytest.fixture(scope="module")
def loaded(tiny_tokenizer):
    return tiny_loaded_model(tiny_tokenizer, positions=128)


def _recipe(info) -> Recipe:
    d, h = info.head_dim, info.num_kv_heads
    tensors = {f"layers.{i}.{s}.rotate": torch.tensor([7 + i, h, d]) for i in range(info.num_layers) for s in "kv"}
    return Recipe(name="rot", layers=[LayerConfig(**LAYOUT)] * info.num_layers, model=info, tensors=tensors)


def test_a_recipe_is_its_simulation(loaded):
    from kvcalib.simulate import simulated_logits

    model, info, ids, p = loaded.model, loaded.info, _ids(loaded), T - LAST
    recipe = _recipe(info)
    with hs.hooked(model):
        prefix, _ = hs.prefill(model, ids, p)
        got = hs.continuation_logits(model, ids, prefix, p, rk.recipe_allocation("r", recipe, info), None)  # (B, C, V)
    want = simulated_logits(model, ids, recipe.layer_configs(info.num_layers), codecs=recipe.codecs(info),
                            prompt_len=p, logits_to_keep=LAST)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_run_writes_a_row_per_recipe(loaded, tmp_path):
    path = tmp_path / "r.safetensors"
    _recipe(loaded.info).save(path)
    res = rk.main(["--context", str(T), "--windows", "2", "--score-last", str(LAST), "--batch", "2",
                   "--recipe", str(path), "--recipe", str(path), "--out", str(tmp_path / "run")],
                  loaded=loaded, texts=corpus_lines(400))
    rows = [r for r in res["rows"] if r["kind"] != "fp"]
    assert len(rows) == 2 and rows[0]["kl"] == rows[1]["kl"] > 1e-9
    assert (tmp_path / "run" / "recipe_kl.md").read_text().count("| ") > 6
