"""The public Python API: lazy re-exports, typed wrappers building their configs from keywords."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvcalib

PUBLIC = ("CompressedCache", "Recipe", "LayerConfig", "load_recipe", "load_model", "collect",
          "evaluate", "search", "KvcalibError")


def test_all_lists_the_public_api():
    for name in PUBLIC:
        assert name in kvcalib.__all__, name
    assert set(kvcalib.__all__) <= set(dir(kvcalib))


@pytest.mark.parametrize("name", [n for n in kvcalib.__all__ if n not in ("__version__", "search", "SearchConfig", "SearchResult")])
def test_every_lazy_name_resolves(name):
    obj = getattr(kvcalib, name)
    assert obj is not None and getattr(kvcalib, name) is obj  # cached after first access


def test_search_comes_from_optimize():
    optimize = pytest.importorskip("kvcalib.optimize")
    if not hasattr(optimize, "search"):  # being written alongside; a namespace package until then
        pytest.skip("kvcalib.optimize does not expose search() yet")
    assert kvcalib.search is optimize.search
    assert kvcalib.SearchConfig is optimize.SearchConfig and kvcalib.SearchResult is optimize.SearchResult


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvcalib.nope  # noqa: B018


def test_import_stays_light():
    code = ("import sys, kvcalib; heavy = [m for m in ('triton', 'optuna', 'sklearn', 'torch', 'transformers') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_objects_are_the_library_ones():
    from kvcalib.errors import KvcalibError
    from kvcalib.layout import LayerConfig
    from kvcalib.recipe import Recipe
    from kvcalib.runtime.cache import CompressedCache

    assert kvcalib.Recipe is Recipe and kvcalib.LayerConfig is LayerConfig
    assert kvcalib.CompressedCache is CompressedCache and kvcalib.KvcalibError is KvcalibError
    rec = kvcalib.load_recipe("kivi-2")
    assert isinstance(rec, Recipe) and rec.default_layer.k_bits == 2
    with pytest.raises(kvcalib.KvcalibError, match="does not exist"):
        kvcalib.load_recipe("missing.safetensors")


def test_docstrings_show_shapes_and_examples():
    for name in ("collect", "evaluate", "load_recipe"):
        doc = getattr(kvcalib, name).__doc__
        assert "Example" in doc and ">>> import kvcalib" in doc, name
    assert "(H_kv, D)" in kvcalib.collect.__doc__


# ------------------------------------------------------------------ wrappers build the configs
@pytest.fixture()
def spy_collect(monkeypatch):
    seen = {}

    def fake(config, out_dir, *, loaded=None):
        seen.update(config=config, out_dir=out_dir, loaded=loaded)
        return "result"

    monkeypatch.setattr("kvcalib.collection.collect", fake)
    return seen


def test_collect_from_keywords(spy_collect, tmp_path):
    from kvcalib.collection import CollectConfig

    assert kvcalib.collect(model="smollm2-135m", data="embedded", samples=3, seq_len=64, block_len=32,
                           out=tmp_path / "run") == "result"
    cfg = spy_collect["config"]
    assert isinstance(cfg, CollectConfig)
    assert (cfg.model, cfg.samples, cfg.seq_len, cfg.block_len) == ("smollm2-135m", 3, 64, 32)
    assert cfg.batch_size == CollectConfig().batch_size  # untouched fields keep their defaults
    assert spy_collect["out_dir"] == tmp_path / "run"


def test_collect_config_and_keyword_overrides(spy_collect, tmp_path):
    from kvcalib.collection import CollectConfig

    base = CollectConfig(samples=4, seq_len=128, block_len=64)
    kvcalib.collect(base, out=str(tmp_path / "a"))
    assert spy_collect["config"] is base and isinstance(spy_collect["out_dir"], Path)
    kvcalib.collect(base, samples=8, out=tmp_path / "b")
    assert spy_collect["config"].samples == 8 and spy_collect["config"].seq_len == 128
    assert base.samples == 4  # the caller's config is not mutated


def test_collect_validates_like_the_cli(spy_collect, tmp_path):
    with pytest.raises(kvcalib.KvcalibError, match="--samples"):
        kvcalib.collect(samples=0, out=tmp_path / "x")
    with pytest.raises(TypeError):
        kvcalib.collect(sample=3, out=tmp_path / "x")  # a typo is an error, not ignored
    with pytest.raises(TypeError, match="CollectConfig"):
        kvcalib.collect({"samples": 3}, out=tmp_path / "x")


def test_evaluate_from_keywords(monkeypatch):
    from kvcalib.eval.harness import EvalConfig

    seen = {}
    monkeypatch.setattr("kvcalib.eval.harness.evaluate",
                        lambda config, loaded=None: seen.update(config=config, loaded=loaded) or ["row"])
    assert kvcalib.evaluate(recipes="kivi-2", metrics="ppl", ppl_samples=2, ppl_seq_len=256,
                            passkey_lengths=[512]) == ["row"]
    cfg = seen["config"]
    assert isinstance(cfg, EvalConfig)
    assert cfg.recipes == ["kivi-2"] and cfg.metrics == ("ppl",) and cfg.ppl_samples == 2
    assert cfg.passkey_lengths == (512,)
    rec = kvcalib.load_recipe("kivi-4")
    kvcalib.evaluate(EvalConfig(recipes=["fp16"], metrics="ppl"), recipes=[rec, "kivi-2"])
    assert seen["config"].recipes == [rec, "kivi-2"] and seen["config"].metrics == ("ppl",)
    with pytest.raises(kvcalib.KvcalibError, match="unknown metric"):
        kvcalib.evaluate(recipes="kivi-2", metrics="bleu")
