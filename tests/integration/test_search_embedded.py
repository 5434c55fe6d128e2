"""A very small ``kvcalib search`` on the real embedded SmolLM2-135M: 3 trials, one short scoring
sequence, outputs written and the chosen recipe within the budget, no machine paths in them
(< 90 s on a 2-core CPU)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.embedded


def test_tiny_search_on_smollm2(tmp_path):
    from kvcalib.models import load_model
    from kvcalib.optimize import SearchConfig, search
    from kvcalib.recipe import Recipe

    loaded = load_model("smollm2-135m", device="cpu")
    cfg = SearchConfig(out=tmp_path / "run", samples=2, seq_len=160, score_samples=1, trials=3, budget_bits=3.5,
                       sweep=False, eval=True, eval_samples=1, eval_seq_len=192, presets=("kivi-2",),
                       space={"groups": [32], "windows": [64], "sinks": [0], "layer_methods": ["clip"]})
    result = search(cfg, loaded=loaded)
    for name in ("stats.safetensors", "study.db", "search.json", "pareto.png", "report.md", "recipe.safetensors"):
        assert (tmp_path / "run" / name).is_file(), name
    assert result.n_trials == 3 and result.effective_bits <= 3.5
    rec = Recipe.load(result.recipe_path)
    rec.check_model(loaded.info)
    assert rec.memory(loaded.info, 4096).effective_bits <= 3.5
    names = [h["name"] for h in result.held_out]
    assert names[1:] == ["kivi-2"] and all(h["ppl_delta_pct"] is not None for h in result.held_out)
    assert "Held-out proof" in (tmp_path / "run" / "report.md").read_text()
    # outputs name the run folder and the searched recipe without machine paths
    for name in ("search.json", "report.md"):
        assert str(tmp_path) not in (tmp_path / "run" / name).read_text(), name
    assert result.held_out[0]["recipe"] == "recipe.safetensors"
    assert rec.provenance["run"] == "run" and str(tmp_path) not in str(rec.provenance)
