"""`kvcalib export` and fitted recipe state applied by the runtime (perm, clip, centering)."""

from __future__ import annotations

import pytest
import torch

from kvcalib.collection import collect_stats
from kvcalib.errors import KvcalibError
from kvcalib.export import ExportConfig, export_fp8_scales, export_recipe, export_search_point, parse_bits
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.recipe import build_codecs
from kvcalib.simulate import simulated_logits
from tests.conftest import tiny_model
from tests.unit.test_cache import decode_logits


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    model = tiny_model("llama", heads=8, kv_heads=4)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (64,), generator=g) for _ in range(6)]
    stats = collect_stats(model, seqs, reservoir_blocks=4, block_len=32, name="tiny", progress=False)
    out = tmp_path_factory.mktemp("run")
    stats.save(out / "stats.safetensors")
    return out, model


def test_parse_bits():
    assert parse_bits("k2v4") == (2, 4)
    with pytest.raises(KvcalibError, match="k<bits>v<bits>"):
        parse_bits("k5v2")


def test_each_export_job_refuses_bad_input_before_writing(tmp_path):
    """The three jobs of `kvcalib export` each check their own inputs (the command only picks one)."""
    run = tmp_path / "run"
    run.mkdir()
    recipe = tmp_path / "r.safetensors"
    for job in (lambda: export_recipe(run, recipe, ExportConfig()), lambda: export_search_point(run, recipe, trial=0),
                lambda: export_fp8_scales(run, tmp_path / "fp8")):
        with pytest.raises(KvcalibError, match="holds no stats.safetensors"):
            job()
    with pytest.raises(KvcalibError, match="FP8 compressed-tensors layout"):
        export_fp8_scales(run, tmp_path / "fp8", bits="k4v4")
    with pytest.raises(KvcalibError, match="FP8 compressed-tensors layout"):
        export_fp8_scales(run, tmp_path / "fp8", methods=["clip"])
    with pytest.raises(KvcalibError, match="--clip build a recipe from statistics"):
        export_search_point(run, recipe, trial=0, methods=["clip"])
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_export_writes_a_fitted_recipe(run_dir, tmp_path):
    out, model = run_dir
    cfg = ExportConfig(bits="k4v2", group=8, window=8, methods=["reorder", "clip", "center"])
    rec = export_recipe(out, tmp_path / "r.safetensors", cfg)
    back = Recipe.load(tmp_path / "r.safetensors")
    assert back.model == rec.model and back.model.name == "tiny"
    assert any(k.endswith("v.perm") for k in back.tensors) and any(k.endswith(".clip") for k in back.tensors)
    assert sorted(back.provenance["methods"]) == ["center", "clip", "reorder"]
    with pytest.raises(KvcalibError, match="already exists"):
        export_recipe(out, tmp_path / "r.safetensors", cfg)


def test_fitted_state_simulation_matches_decode(run_dir):
    _, model = run_dir
    cfg = LayerConfig(k_bits=4, v_bits=2, k_group=8, v_group=8, window=8)
    perm = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(h)) for h in range(4)])
    tensors = {}
    for i in range(2):
        tensors[f"layers.{i}.v.perm"] = perm
        tensors[f"layers.{i}.k.clip"] = torch.full((4, 1), 0.9)
        tensors[f"layers.{i}.v.center"] = torch.tensor(8.0)
    rec = Recipe(name="fitted", layers=[cfg, cfg], tensors=tensors)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    dec, cache = decode_logits(model, ids, rec, 1)
    sim = simulated_logits(model, ids, [cfg, cfg], build_codecs(rec, [cfg, cfg], 16), prompt_len=1)
    assert float((sim - dec).abs().max()) < 1e-3
    assert cache.nbytes()["v_mean"] > 0  # the stored mean is counted


def test_centering_and_perm_round_trip_exactly_at_16_bit_mean():
    from kvcalib.codec import LayerCodec

    cfg = LayerConfig(k_bits=8, v_bits=8, k_group=8, v_group=8, window=8)
    perm = torch.stack([torch.randperm(16) for _ in range(2)])
    codec = LayerCodec(cfg, v_perm=perm, v_center=16, k_center=16)
    x = torch.randn(1, 2, 8, 16) * 3 + torch.randn(1, 1, 8, 16) * 10  # shared offset across heads
    err_plain = (LayerCodec(cfg).roundtrip_values(x) - x).abs().mean()
    err = (codec.roundtrip_values(x) - x).abs().mean()
    assert err < err_plain  # centering removes the shared offset from the quantized range


def test_unknown_tensor_refused():
    from kvcalib.errors import RecipeError

    rec = Recipe(name="x", layers=[LayerConfig()], tensors={"layers.0.k.future_thing": torch.ones(1)})
    with pytest.raises(RecipeError, match="future_thing"):
        build_codecs(rec, rec.layers)


# ---------------------------------------------------------------------- OTT and PATS (issue 4)


def test_export_outliers_follow_the_fitted_gain(run_dir, tmp_path):
    """--outliers N: OutlierMethod per layer: N where the recorded key-error gain reaches 5 %, else 0."""
    out, _ = run_dir
    rec = export_recipe(out, tmp_path / "o.safetensors", ExportConfig(bits="k2v2", group=8, window=8, outliers=3))
    back = Recipe.load(tmp_path / "o.safetensors")
    for i in range(2):
        pool, gain = int(back.tensors[f"layers.{i}.kv.outlier_pool"]), float(back.tensors[f"layers.{i}.kv.outlier_gain"])
        assert pool == (3 if gain >= 0.05 else 0)
    assert rec.provenance["outliers"] == 3 and "outliers" in rec.provenance["methods"]
    assert rec.name == "k2v2-g8-ott3"
    codecs = build_codecs(back, back.layers, 16)
    assert [c.pool_size for c in codecs] == [int(back.tensors[f"layers.{i}.kv.outlier_pool"]) for i in range(2)]


def test_export_schedule_writes_tiers_that_start_at_the_bits(run_dir, tmp_path):
    out, _ = run_dir
    cfg = ExportConfig(bits="k8v4", group=8, window=8, schedule="middle-heavy", schedule_ages=(16, 32))
    assert cfg.sinks == 4 and cfg.window == 8  # PATS middle-heavy keeps both ends: 4 sinks
    rec = export_recipe(out, tmp_path / "s.safetensors", cfg)
    back = Recipe.load(tmp_path / "s.safetensors")
    assert back.tensors["layers.1.kv.schedule"].tolist() == [[0, 16, 16], [8, 8, 4], [16, 4, 2], [32, 2, 2]]
    assert back.layers[0].sinks == 4 and rec.name == "k8v4-g8-middle-heavy"
    assert build_codecs(back, back.layers, 16)[0].tiers == [(8, 8, 4), (16, 4, 2), (32, 2, 2)]
    flat = export_recipe(out, tmp_path / "f.safetensors", ExportConfig(bits="k8v4", group=8, window=8, sinks=4))
    bits, flat_bits = rec.memory(rec.model, 4096).effective_bits, flat.memory(flat.model, 4096).effective_bits
    assert bits < flat_bits - 2.0, "at 4096 tokens nearly every block is at 2 bits"
    old = ExportConfig(bits="k8v4", group=8, window=8, schedule="old-heavy", schedule_ages=(16, 32))
    new = ExportConfig(bits="k2v2", group=8, schedule="new-heavy")
    def layer_schedule(c):
        return c.method("schedule").schedule_for(c.layer)

    assert old.sinks == 0 and layer_schedule(old).tiers == layer_schedule(cfg).tiers
    assert (new.window, new.sinks) == (0, 4) and layer_schedule(new).to_tensor().tolist() == [[0, 2, 2]]


def test_exported_ott_and_pats_recipe_simulates_as_it_decodes(run_dir, tmp_path):
    out, model = run_dir
    cfg = ExportConfig(bits="k8v4", group=8, window=8, outliers=2, schedule="middle-heavy", schedule_ages=(16, 32))
    rec = export_recipe(out, tmp_path / "b.safetensors", cfg)
    rec.tensors.update({f"layers.{i}.kv.outlier_pool": torch.tensor(2) for i in range(2)})  # pools on, whatever the gain
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(5))
    dec, cache = decode_logits(model, ids, rec, 1)
    sim = simulated_logits(model, ids, rec.layers, build_codecs(rec, rec.layers, 16), prompt_len=1)
    assert float((sim - dec).abs().max()) < 1e-3
    assert cache.nbytes()["outlier_pool"] > 0 and cache.layers[0].packed.stores[-1].n > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(outliers=-1), "--outliers"),
    (dict(outliers=2.5), "--outliers"),
    (dict(schedule="heavy"), "--schedule 'heavy' is not known"),
    (dict(schedule="old-heavy", sinks=4), "no sinks"),
    (dict(schedule="middle-heavy", sinks=0), "--sinks is 0"),
    (dict(schedule="new-heavy", window=128), "--window 0"),
    (dict(schedule="middle-heavy", schedule_ages=(4096, 1024)), "strictly increasing"),
    (dict(schedule="middle-heavy", schedule_ages=(64,)), "above the window"),
    (dict(schedule="middle-heavy", bits="k16v16"), "full precision"),
])
def test_export_refuses_bad_ott_and_pats_settings(kwargs, match):
    with pytest.raises(KvcalibError, match=match):
        ExportConfig(**{"bits": "k4v2", **kwargs})


@pytest.mark.parametrize("args, needle", [
    (["--schedule", "sideways"], "--schedule 'sideways' is not known"),
    (["--outliers", "-3"], "--outliers"),
    (["--schedule", "middle-heavy", "--schedule-ages", "10,x"], "--schedule-ages"),
    (["--schedule", "middle-heavy", "--sinks", "0"], "--sinks is 0"),
])
def test_cli_export_bad_flags_exit_2_with_one_line(run_dir, tmp_path, args, needle):
    from typer.testing import CliRunner

    from kvcalib.cli import app

    out, _ = run_dir
    result = CliRunner().invoke(app, ["export", str(out), "-o", str(tmp_path / "r.safetensors"), *args])
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r.safetensors").exists()


def test_cli_export_with_outliers_and_schedule(run_dir, tmp_path):
    from typer.testing import CliRunner

    from kvcalib.cli import app

    out, _ = run_dir
    path = tmp_path / "r.safetensors"
    result = CliRunner().invoke(app, ["export", str(out), "-o", str(path), "--bits", "k4v2", "--group", "8",
                                      "--window", "8", "--outliers", "3", "--schedule", "middle-heavy",
                                      "--schedule-ages", "64,256"])
    assert result.exit_code == 0, result.output
    rec = Recipe.load(path)
    assert rec.tensors["layers.0.kv.schedule"].tolist() == [[0, 16, 16], [8, 4, 2], [64, 2, 2]]
    assert "layers.1.kv.outlier_pool" in rec.tensors and rec.layers[1].sinks == 4


def test_cli_export_huffman_adds_loadable_codebooks(run_dir, tmp_path):
    """--huffman stores code lengths for coded sides; they rebuild complete canonical codebooks
    and inspect reports their expected bits per symbol below the fixed width."""
    from typer.testing import CliRunner

    from kvcalib.methods.huffman import load_codebooks
    from kvcalib.cli import app

    out, _ = run_dir
    path = tmp_path / "h.safetensors"
    result = CliRunner().invoke(app, ["export", str(out), "-o", str(path), "--bits", "k8v8", "--group", "8",
                                      "--window", "8", "--huffman"])
    assert result.exit_code == 0, result.output
    rec = Recipe.load(path)
    names = [k for k in rec.tensors if k.endswith(".huffman")]
    assert names, "8-bit codes of real activations are skewed: at least one side must be coded"
    books = load_codebooks(rec, rec.layers)
    assert len(books) == len(names)
    for book in books.values():
        assert book.bits == 8 and int(book.lengths.max()) <= 12
    shown = CliRunner().invoke(app, ["inspect", str(path)])
    assert shown.exit_code == 0 and "huffman" in shown.output.lower(), shown.output
