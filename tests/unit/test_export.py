"""`kvcalib export` and fitted recipe state applied by the runtime (perm, clip, centering)."""

from __future__ import annotations

import pytest
import torch

from kvcalib.collection import collect_stats
from kvcalib.errors import KvcalibError
from kvcalib.export import ExportConfig, export_recipe, parse_bits
from kvcalib.recipe import LayerConfig, Recipe
from kvcalib.runtime.cache import CompressedCache
from kvcalib.runtime.state import build_codecs
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
        parse_bits("k3v2")


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
    from kvcalib.runtime.codec import LayerCodec

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
