"""FP8 serving export: compressed-tensors names, shapes, dtypes, exact scales, config, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvcalib.errors import KvcalibError
from kvcalib.layout import LayerConfig
from kvcalib.recipe import Recipe
from kvcalib.serving import (FP8_E4M3_MAX, SCALES_FILE, export_compressed_tensors, kv_cache_scheme,
                             recipe_to_serving)
from kvcalib.stats import CollectedStats, LayerStats
from tests.conftest import tiny_config

H, D, LAYERS, HQ = 2, 16, 2, 4


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """A collect run folder with synthetic statistics of a tiny llama saved as a local folder."""
    from kvcalib.models import model_info

    folder = tmp_path / "tiny-llama"
    config = tiny_config("llama")
    config.save_pretrained(folder)
    info = model_info(config, folder.name)
    g = torch.Generator().manual_seed(0)
    layers = []
    for i in range(LAYERS):
        def side(scale: float) -> dict[str, torch.Tensor]:
            lo = -torch.rand(H, D, generator=g) * scale  # (H, D)
            hi = torch.rand(H, D, generator=g) * scale * 1.3  # (H, D)
            return {"count": torch.tensor(100), "min": lo, "max": hi, "mean": (lo + hi) / 2,
                    "absmax": torch.maximum(lo.abs(), hi.abs()), "sq_mean": hi**2}
        k, v = side(10.0 * (i + 1)), side(1.0 + i)
        if i == 1:
            v["absmax"][1] = 0.0  # a head that never saw a non-zero value
        layers.append(LayerStats(k=k, v=v, reservoir_k=torch.zeros(1, 4, H, D, dtype=torch.float16),
                                 reservoir_v=torch.zeros(1, 4, H, D, dtype=torch.float16),
                                 reservoir_q=torch.zeros(1, 4, HQ, D, dtype=torch.float16), scaling=D**-0.5))
    run = tmp_path / "run"
    run.mkdir()
    CollectedStats(model=info, layers=layers, config={"data": "embedded", "samples": 2, "seq_len": 64, "seed": 0}).save(run / "stats.safetensors")
    (run / "run.json").write_text(json.dumps({"model_source": str(folder)}))
    return run


def _read(out: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(out / SCALES_FILE), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_per_tensor_scales_reproduce_statistics(run_dir: Path, tmp_path: Path) -> None:
    out = export_compressed_tensors(run_dir, tmp_path / "serve")
    tensors = _read(out)
    stats = CollectedStats.load(run_dir)
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{s}_scale" for i in range(LAYERS) for s in "kv")
    for i, layer in enumerate(stats.layers):
        for s in "kv":
            t = tensors[f"model.layers.{i}.self_attn.{s}_scale"]
            assert t.dtype == torch.float32 and t.shape == (1,)
            want = getattr(layer, s)["absmax"].amax().reshape(1) / FP8_E4M3_MAX
            assert torch.equal(t, want)  # exact: the same float32 division
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"] == {}
    assert q["kv_cache_scheme"] == kv_cache_scheme(False)
    assert q["kv_cache_scheme"]["num_bits"] == 8 and q["kv_cache_scheme"]["type"] == "float"
    assert config["num_hidden_layers"] == LAYERS  # the rest of the model's config is kept
    record = json.loads((out / "kvcalib_serving.json").read_text())
    assert record["strategy"] == "tensor" and record["calibration"]["samples"] == 2


def test_per_head_scales_have_attn_head_shape(run_dir: Path, tmp_path: Path) -> None:
    out = export_compressed_tensors(run_dir, tmp_path / "serve", per_head=True)
    tensors = _read(out)
    stats = CollectedStats.load(run_dir)
    for i, layer in enumerate(stats.layers):
        for s in "kv":
            t = tensors[f"model.layers.{i}.self_attn.{s}_scale"]
            assert t.shape == (H, 1, 1) and t.dtype == torch.float32
            absmax = getattr(layer, s)["absmax"].amax(dim=1)  # (H,)
            want = torch.where(absmax > 0, absmax / FP8_E4M3_MAX, torch.ones_like(absmax))
            assert torch.equal(t.flatten(), want)
    assert tensors["model.layers.1.self_attn.v_scale"][1].item() == 1.0  # all-zero head: engine default
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["kv_cache_scheme"]["strategy"] == "attn_head"


def test_clip_scales_and_validates(run_dir: Path, tmp_path: Path) -> None:
    full = _read(export_compressed_tensors(run_dir, tmp_path / "a"))
    clipped = _read(export_compressed_tensors(run_dir, tmp_path / "b", clip=0.5))
    for name in full:
        torch.testing.assert_close(clipped[name], full[name] * 0.5, rtol=1e-6, atol=0)
    with pytest.raises(KvcalibError, match="clip"):
        export_compressed_tensors(run_dir, tmp_path / "c", clip=1.5)


def test_existing_output_refused_without_force(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(KvcalibError, match="not empty"):
        export_compressed_tensors(run_dir, out)
    assert (out / "keep.txt").read_text() == "user data"  # untouched
    export_compressed_tensors(run_dir, out, force=True)
    assert (out / SCALES_FILE).is_file() and not (out / "keep.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".serve")]  # no temporaries left


def test_model_folder_needed_and_checked(run_dir: Path, tmp_path: Path) -> None:
    run_json = run_dir / "run.json"
    run_json.write_text(json.dumps({"model_source": "org/some-hub-model"}))
    with pytest.raises(KvcalibError, match="--model FOLDER"):
        export_compressed_tensors(run_dir, tmp_path / "serve")
    other = tmp_path / "other"
    tiny_config("llama", kv_heads=4).save_pretrained(other)
    with pytest.raises(KvcalibError, match="num_kv_heads"):
        export_compressed_tensors(run_dir, tmp_path / "serve", model=other)
    out = export_compressed_tensors(run_dir, tmp_path / "serve", model=tmp_path / "tiny-llama")
    assert (out / "config.json").is_file()


def test_low_bit_recipe_refused_with_what_can_be_exported(run_dir: Path, tmp_path: Path) -> None:
    rec = Recipe(name="k2v4", default_layer=LayerConfig(k_bits=2, v_bits=4, window=128),
                 provenance={"statistics": str(run_dir)})
    with pytest.raises(KvcalibError) as err:
        recipe_to_serving(rec, tmp_path / "serve")
    msg = str(err.value)
    assert "2/4-bit" in msg and "k_scale/v_scale" in msg and str(run_dir) in msg
    assert not (tmp_path / "serve").exists()
    with pytest.raises(KvcalibError, match="FP8"):
        recipe_to_serving("kivi-2", tmp_path / "serve")
    rec8 = Recipe(name="k8v8", default_layer=LayerConfig(k_bits=8, v_bits=8, window=128),
                  provenance={"statistics": str(run_dir)})
    out = recipe_to_serving(rec8, tmp_path / "serve")
    assert (out / SCALES_FILE).is_file()


def test_round_trip_through_compressed_tensors(run_dir: Path, tmp_path: Path) -> None:
    quant = pytest.importorskip("compressed_tensors.quantization")
    for per_head in (False, True):
        out = export_compressed_tensors(run_dir, tmp_path / f"serve{per_head}", per_head=per_head)
        q = json.loads((out / "config.json").read_text())["quantization_config"]
        parsed = quant.QuantizationConfig.model_validate(q)
        args = parsed.kv_cache_scheme
        assert args.num_bits == 8 and args.type == "float" and args.symmetric and not args.dynamic
        assert args.strategy == (quant.QuantizationStrategy.ATTN_HEAD if per_head else quant.QuantizationStrategy.TENSOR)
        assert parsed.quant_method == "compressed-tensors"
        # our entry is exactly what compressed-tensors serialises for these arguments
        ref = quant.QuantizationArgs(num_bits=8, type="float", strategy=args.strategy, dynamic=False, symmetric=True)
        assert q["kv_cache_scheme"] == ref.model_dump()


def test_cli_refuses_sub8bit_compressed_tensors(tmp_path):
    from typer.testing import CliRunner

    from kvcalib.cli import app

    result = CliRunner().invoke(app, ["export", str(tmp_path), "--format", "compressed-tensors",
                                      "--bits", "k2v2", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "FP8" in result.output and "--format compressed-tensors" in result.output
    assert not (tmp_path / "out").exists()
