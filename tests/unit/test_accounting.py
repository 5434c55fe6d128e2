"""Issue 38: effective bits count the tokens each layer holds (a sliding-window layer its window),
so bf16 is 16.0 on every model, a number of bits means the same compression everywhere, and the
search, its report and old files agree with that. Tiny configs only: a gemma3-like model (sliding
and global layers alternate), a mistral-v0.1-like one (every layer sliding) and a llama one of the
same shape (no sliding layer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from kvcalib.errors import KvcalibError, RecipeError
from kvcalib.inspect import inspect_recipe
from kvcalib.layout import (ACCOUNTING, LEGACY_ACCOUNTING, LayerConfig, held_elements, layer_bytes,
                            legacy_bits_factor)
from kvcalib.models import model_info
from kvcalib.recipe import METADATA_KEY, Recipe, load_preset, with_layers
from tests.conftest import tiny_config, tiny_model

LAYERS = 4
# 8,192 positions: the accounting is read at 4,096 tokens, and kvcalib refuses a context beyond the model's
SHAPE = dict(layers=LAYERS, heads=4, kv_heads=2, head_dim=16, positions=8192)
# K and V at 4 bits, keys per channel over 16-token groups, values per token over 16 channels,
# a 32-token full-precision window: the hand count below is for this layer
UNIFORM_4BIT = LayerConfig(k_bits=4, v_bits=4, k_group=16, v_group=16, window=32)
REPO = Path(__file__).resolve().parents[2]


def _info(kind: str, window: int = 8):
    """``global`` (llama), ``mixed`` (gemma3-like: layers 0 and 2 slide) or ``sliding``
    (mistral-v0.1-like: every layer slides), all of one shape."""
    if kind == "global":
        return model_info(tiny_config("llama", **SHAPE), "tiny-llama")
    if kind == "mixed":
        return model_info(tiny_config("gemma3", sliding_window=window, **SHAPE), "tiny-gemma3")
    cfg = tiny_config("mistral", **SHAPE)
    cfg.sliding_window = window  # Mistral-7B-v0.1: one window on every layer
    return model_info(cfg, "tiny-mistral-v0.1")


def _fitted(cfg: LayerConfig, info, name: str = "r", **kw) -> Recipe:
    return Recipe(name=name, layers=[cfg] * info.num_layers, model=info, **kw)


def test_tiny_configs_slide_as_their_models():
    assert _info("global").sliding_window == (None,) * LAYERS
    assert _info("mixed").sliding_window == (8, None, 8, None)
    assert _info("sliding").sliding_window == (8,) * LAYERS


# ------------------------------------------------------------------ bf16 is 16.0
@pytest.mark.parametrize("kind", ["mixed", "sliding"])
@pytest.mark.parametrize("context", [3, 8, 9, 100, 4096])
def test_bf16_is_exactly_16_below_and_above_the_window(kind, context):
    info = _info(kind)
    mem = load_preset("fp16").memory(info, context)
    assert mem.effective_bits == 16.0 and mem.compression_ratio == 1.0
    assert mem.total_bytes == mem.bf16_bytes == 2 * held_elements(2, 16, context, info.sliding_window)
    report = inspect_recipe(_fitted(LayerConfig(), info, "fp16"), context=context)
    assert report["memory"]["effective_bits"] == 16.0 and report["memory"]["compression_ratio"] == 1.0
    assert [r["effective_bits"] for r in report["layers"]] == [16.0] * LAYERS  # sliding layers too
    assert [r["held_tokens"] for r in report["layers"]] == [min(context, w or context) for w in info.sliding_window]
    # the first accounting counted every layer at T: above the window bf16 read fewer bits
    legacy = 8 * mem.total_bytes / (2 * LAYERS * 2 * 16 * context)
    if context > 8:
        assert legacy < 16.0 and legacy * legacy_bits_factor(context, info.sliding_window) == pytest.approx(16.0)
    else:
        assert legacy == 16.0 and legacy_bits_factor(context, info.sliding_window) == 1.0


def test_non_sliding_numbers_are_unchanged():
    """The committed SmolLM2 recipe (schema 1) and the presets keep the numbers measured before
    issue 38 (`kvcalib inspect` on the previous commit)."""
    rec = Recipe.load(REPO / "recipes/smollm2-135m/short-256-3.0b/recipe.safetensors")
    assert rec.accounting == LEGACY_ACCOUNTING  # schema 1: recorded bits are of the first accounting
    assert rec.memory(rec.model, 4096).effective_bits == 2.9865858289930554
    assert rec.memory(rec.model, 4096).total_bytes == 17615600.0
    smol = rec.model
    for preset, bits, nbytes in (("fp16", 16.0, 94371840.0), ("kivi-2", 3.40625, 20090880.0),
                                 ("kivi-4", 5.34375, 31518720.0), ("pertoken-4", 4.5, 26542080.0)):
        mem = load_preset(preset).memory(smol, 4096)
        assert (mem.effective_bits, mem.total_bytes) == (bits, nbytes), preset
        assert mem.compression_ratio == 16.0 / bits


# ------------------------------------------------------------------ same bits, same compression
def test_uniform_4bit_is_the_same_number_on_sliding_and_global_models_within_the_window():
    # at T = 256: 32 window tokens in bf16, 224 tokens packed (14 key groups); per layer and head
    # 32*16*2*2 (window K+V) + 224*16*4/8*2 (codes) + 14*16*2*2 (K scale+zero per channel and
    # group) + 224*1*2*2 (V scale+zero per token and group) = 7424 bytes over 2*16*256 elements
    want = 8 * 7424 / (2 * 16 * 256)
    assert want == 7.25
    for kind in ("global", "mixed", "sliding"):
        mem = _fitted(UNIFORM_4BIT, _info(kind, window=512)).memory(_info(kind, window=512), 256)
        assert mem.effective_bits == want, kind
        assert mem.compression_ratio == 16.0 / want
    # beyond the window a sliding layer holds fewer tokens, so more of them sit in the bf16 window:
    # its bits differ, but bits and compression against its own bf16 cache still say the same thing
    info = _info("sliding", window=512)
    mem = _fitted(UNIFORM_4BIT, info).memory(info, 4096)
    per_layer = sum(layer_bytes(UNIFORM_4BIT, 2, 16, 4096, 512).values())
    assert mem.effective_bits == 8 * per_layer / (2 * 2 * 16 * 512)  # every layer holds 512 tokens
    assert mem.compression_ratio == pytest.approx(16.0 / mem.effective_bits)


@pytest.mark.parametrize("context", [64, 200])
def test_search_budget_means_the_same_compression_on_sliding_and_global(context):
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point, SearchSpace
    from kvcalib.optimize.study import floor_bits

    space = SearchSpace(bits=(2, 4, 8), groups=(8,), windows=(8, 16), sinks=(0,), layer_methods=())
    points = [Point(8, 8, 0, (2,) * LAYERS, (2,) * LAYERS, ((),) * LAYERS),
              Point(8, 16, 0, (8, 2, 4, 2), (4, 4, 2, 8), ((),) * LAYERS)]
    ids = torch.zeros(1, 2, dtype=torch.long)
    bits = {}
    for kind in ("global", "mixed", "sliding"):
        info = _info(kind, window=256)  # every context here is within the window
        obj = SearchObjective(None, info, None, ids, context=context)
        bits[kind] = (floor_bits(obj, space), [obj.effective_bits(p, with_tensors=False) for p in points])
        for p in points:  # the budget constrains 16 / compression against the model's own bf16 cache
            mem = Recipe(name="p", layers=p.layer_configs(), model=info).memory(info, context)
            assert mem.effective_bits == obj.effective_bits(p, with_tensors=False)
            assert mem.compression_ratio == pytest.approx(16.0 / mem.effective_bits)
        all16 = Point(8, 8, 0, (16,) * LAYERS, (16,) * LAYERS, ((),) * LAYERS)
        assert obj.effective_bits(all16, with_tensors=False) == 16.0
    assert bits["global"] == bits["mixed"] == bits["sliding"]


def test_runtime_cache_counts_the_tokens_a_sliding_layer_holds():
    from kvcalib.runtime.cache import CompressedCache

    model = tiny_model("gemma3", sliding_window=8).to(torch.bfloat16)  # 16-bit storage, as accounted
    cache = CompressedCache.from_recipe(model, load_preset("fp16"))
    model.generate(torch.randint(0, 128, (1, 6)), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                   past_key_values=cache)
    assert cache.layers[0].n_seen > 8 and cache.layers[0].sliding_window == 8  # past the window
    assert cache.effective_bits() == 16.0


# ------------------------------------------------------------------ files say their accounting
def test_recipes_record_their_accounting_and_schema_1_still_loads(tmp_path):
    info = _info("mixed")
    rec = _fitted(UNIFORM_4BIT, info, provenance={"effective_bits": 7.25})
    rec.save(tmp_path / "new.safetensors")
    back = Recipe.load(tmp_path / "new.safetensors")
    assert back.accounting == ACCOUNTING and back.metadata()["schema_version"] == 2
    assert back.metadata()["accounting"] == ACCOUNTING
    old = back.metadata()
    old["schema_version"] = 1
    del old["accounting"]
    save_file({}, str(tmp_path / "old.safetensors"), metadata={METADATA_KEY: json.dumps(old)})
    legacy = Recipe.load(tmp_path / "old.safetensors")
    assert legacy.accounting == LEGACY_ACCOUNTING and legacy.layers == back.layers
    assert with_layers(legacy, LAYERS, sinks=0).accounting == LEGACY_ACCOUNTING  # a copy keeps it
    for doc, match in (({**old, "accounting": ACCOUNTING}, "unknown fields"),  # schema 1 had no such field
                       ({**old, "schema_version": 2}, "field accounting is None"),
                       ({**old, "schema_version": 2, "accounting": "bytes"}, "field accounting is 'bytes'")):
        save_file({}, str(tmp_path / "bad.safetensors"), metadata={METADATA_KEY: json.dumps(doc)})
        with pytest.raises(RecipeError, match=match):
            Recipe.load(tmp_path / "bad.safetensors")


def test_inspect_cli_prints_16_and_the_compression(tmp_path):
    from kvcalib.cli import app

    info = _info("mixed")
    path = tmp_path / "fp16.safetensors"
    _fitted(LayerConfig(), info, "fp16").save(path)
    out = CliRunner().invoke(app, ["inspect", str(path), "--context", "4096"]).output
    assert "effective bits per element at 4096: 16.000 (bf16 = 16.0)" in out
    assert "compression vs the model's bf16 cache (1,050,624 bytes): 1.00x" in out  # 2*2*16*(8+4096+8+4096)*2
    assert "elements counted over the 8,208 tokens the 4 layers hold, not 4 x 4096" in out
    # a schema-1 recipe's recorded bits are of the old accounting: inspect says how to read them
    legacy = Recipe(name="old", layers=[UNIFORM_4BIT] * LAYERS, model=info, accounting=LEGACY_ACCOUNTING,
                    provenance={"effective_bits": 2.0})
    legacy.save(tmp_path / "old.safetensors")
    out = CliRunner().invoke(app, ["inspect", str(tmp_path / "old.safetensors")]).output
    assert f"multiply them by {4 * 4096 / 8208:.4f} to compare" in out


# ------------------------------------------------------------------ comparisons at equal memory
def test_presets_with_fewer_bits_are_not_comparable():
    from kvcalib.optimize.report import NOT_COMPARABLE, at_equal_memory, held_out_rows

    assert at_equal_memory(2.656, 0.004, 1.219, 5.6) == NOT_COMPARABLE  # issue 38's gemma3 table
    assert at_equal_memory(3.0, 4.9, 3.40625, 10.8) == "win (it holds 1.135x the memory)"
    assert at_equal_memory(3.0, 4.9, 5.34375, 0.12) == "loss (it holds 1.781x the memory)"
    assert at_equal_memory(3.0, 1.0, 3.0, 1.0) == "tie (same bits)"
    assert at_equal_memory(3.0, None, 3.0, 1.0) == "comparable (same bits)"
    held = [{"name": "chosen", "effective_bits": 2.656, "ppl_delta_pct": 0.004},
            {"name": "kivi-2", "effective_bits": 4.5, "ppl_delta_pct": 5.6},
            {"name": "cheap", "effective_bits": 1.219, "ppl_delta_pct": 5.6}]
    cols, rows = held_out_rows(held, {}, "chosen")
    assert cols[-1] == "chosen vs it"
    assert [r[-1] for r in rows] == ["chosen", "win (it holds 1.694x the memory)", NOT_COMPARABLE]
    assert held_out_rows(held, {})[0][-1] == "Δppl %"  # no chosen row: no comparison column


def test_curve_marks_a_cheaper_preset_not_comparable(tmp_path):
    from benchmarks import search_curve as curve  # (moved out of the wheel: issue 52)

    run = tmp_path / "run"
    curve.write_plan(run, "tiny", [("kivi-2", 3.40625)], {"fp16": 16.0, "kivi-2": 3.40625}, {})
    (run / "budget-kivi-2").mkdir()
    (run / "budget-kivi-2" / "search.json").write_text(json.dumps({"chosen": None, "trials": []}))
    # the searched point came out above kivi-2's bits (e.g. exported at a looser budget)
    (run / "eval.json").write_text(json.dumps([
        {"name": "s", "recipe": str(run / "points" / "kivi-2.safetensors"), "effective_bits": 3.5, "ppl": 28.0,
         "ppl_delta_pct": 1.8},
        {"name": "kivi-2", "recipe": "kivi-2", "effective_bits": 3.40625, "ppl": 30.5, "ppl_delta_pct": 10.9},
        {"name": "fp16", "recipe": "fp16", "effective_bits": 16.0, "ppl": 27.5, "ppl_delta_pct": 0.0}]))
    doc = curve.collect_curve(run)
    assert doc["accounting"] == ACCOUNTING
    target = doc["targets"][0]
    assert target["comparable"] is False and target["met"] is None
    verdicts = {c["preset"]: c["verdict"] for c in doc["comparisons"]}
    assert verdicts == {"kivi-2": "not comparable (fewer bits)", "fp16": "loss (it holds 4.571x the memory)"}
    md = curve.markdown(doc)
    assert "**not comparable (the preset holds fewer bits)**" in md and "## At equal memory" in md
    # a run planned with the first accounting on a sliding model (fp16 under 16 bits) is refused
    plan = json.loads((run / "curve-plan.json").read_text())
    del plan["accounting"]
    plan["preset_bits"]["fp16"] = 4.333
    (run / "curve-plan.json").write_text(json.dumps(plan))
    with pytest.raises(KvcalibError, match="planned with the 'all-layers-at-context' accounting"):
        curve.collect_curve(run)
    plan["preset_bits"]["fp16"] = 16.0  # ... and accepted where its numbers are today's
    (run / "curve-plan.json").write_text(json.dumps(plan))
    assert curve.collect_curve(run)["points"][0]["effective_bits"] == 3.5


# ------------------------------------------------------------------ a search on a sliding model
@pytest.fixture(scope="module")
def sliding_search(tmp_path_factory):
    """A 4-trial search on a tiny gemma3-like model at a context 8x its window."""
    from kvcalib.collection import collect_stats
    from kvcalib.optimize import SearchConfig, search_with

    model = tiny_model("gemma3", sliding_window=16, **SHAPE)
    info = model_info(model.config, "tiny-gemma3")
    g = torch.Generator().manual_seed(0)
    stats = collect_stats(model, torch.randint(0, 128, (4, 32), generator=g), reservoir_blocks=4, block_len=16,
                          name="tiny-gemma3", progress=False)
    ids = torch.randint(0, 128, (2, 40), generator=g)  # (M, T) scoring sequences
    run = tmp_path_factory.mktemp("sliding") / "run"
    run.mkdir()
    stats.save(run / "stats.safetensors")
    space = {"bits": [2, 4, 8], "groups": [8], "windows": [8], "sinks": [0], "layer_methods": []}
    cfg = SearchConfig(out=run, trials=4, budget_bits=9.0, space=space, eval=False, presets=("fp16",), context=128,
                       chosen_methods=())  # no Huffman finish: the recipe is exactly the chosen trial
    doc = search_with(cfg, model, info, stats, ids, run, progress=False)
    return model, info, stats, ids, cfg, doc, run


def test_sliding_search_records_accounting_and_compares_at_equal_memory(sliding_search):
    model, info, stats, ids, cfg, doc, run = sliding_search
    assert doc["version"] == 2 and doc["accounting"] == ACCOUNTING
    assert doc["presets"][0]["effective_bits"] == 16.0  # fp16 on a model whose window is 1/8 of the context
    chosen = next(t for t in doc["trials"] if t["number"] == doc["chosen"])
    rec = Recipe.load(run / "recipe.safetensors")
    assert rec.accounting == ACCOUNTING and rec.memory(info, 128).effective_bits == chosen["effective_bits"] <= 9.0
    report = (run / "report.md").read_text()
    assert "i.e. 1.78x smaller than the model's bf16 cache" in report
    assert f"{16 / chosen['effective_bits']:.2f}x smaller than bf16" in report
    assert f"| fp16 | 16 | 0 | loss (it holds {16 / chosen['effective_bits']:.3f}x the memory) |" in report


def test_export_reads_an_old_search_json_converted(sliding_search, tmp_path):
    from kvcalib.export import export_search_point
    from kvcalib.optimize import current_accounting

    model, info, stats, ids, cfg, doc, run = sliding_search
    factor = legacy_bits_factor(128, info.sliding_window)
    assert factor == 4 * 128 / (16 + 128 + 16 + 128)
    old = json.loads((run / "search.json").read_text())
    old["version"] = 1
    del old["accounting"]
    for t in old["trials"]:
        t["effective_bits"] /= factor  # what the first accounting recorded for the same bytes
    old["budget_bits"] /= factor
    back = current_accounting(old)
    assert back["accounting_converted"] == {"from": LEGACY_ACCOUNTING, "factor": factor}
    assert [t["effective_bits"] for t in back["trials"]] == pytest.approx([t["effective_bits"] for t in doc["trials"]])
    legacy_run = tmp_path / "legacy"
    legacy_run.mkdir()
    for name in ("stats.safetensors", "run.json"):
        if (run / name).is_file():
            (legacy_run / name).write_bytes((run / name).read_bytes())
    (legacy_run / "search.json").write_text(json.dumps(old))
    rec, record = export_search_point(legacy_run, tmp_path / "r.safetensors", budget_bits=cfg.budget_bits)
    assert record["number"] == doc["chosen"]  # the same budget picks the same trial: same memory
    assert rec.provenance["budget_bits"] == pytest.approx(cfg.budget_bits)
    assert rec.provenance["accounting_converted"]["factor"] == factor
    assert Recipe.load(tmp_path / "r.safetensors").accounting == ACCOUNTING


def test_resuming_a_study_of_the_old_accounting_is_refused_on_a_sliding_model(sliding_search, tmp_path):
    import optuna

    from kvcalib.optimize import SearchConfig, search_with

    model, info, stats, ids, cfg, doc, run = sliding_search
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("study.db", "stats.safetensors"):
        (copy / name).write_bytes((run / name).read_bytes())
    study = optuna.load_study(study_name="kvcalib-search", storage=f"sqlite:///{copy / 'study.db'}")
    study.set_user_attr("accounting", LEGACY_ACCOUNTING)  # as a study made before issue 38 reads
    again = SearchConfig(**{**cfg.__dict__, "space": cfg.space.to_dict(), "out": copy, "resume": True, "trials": 5})
    with pytest.raises(KvcalibError, match="counted effective bits as 'all-layers-at-context'"):
        search_with(again, model, info, stats, ids, copy, progress=False)
