"""Recipe v1: presets, round trip, validation naming the field, refusal of another model, fuzzing."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvcalib.errors import RecipeError
from kvcalib.models import ModelInfo
from kvcalib.layout import LayerConfig
from kvcalib.recipe import METADATA_KEY, Recipe, list_presets, load_preset

INFO = ModelInfo("smollm2-135m", "llama", 30, 9, 3, 64, 8192, (None,) * 30, "cc1cfbf31f103bfa")


def test_presets_ship_and_are_model_agnostic():
    assert set(list_presets()) >= {"fp16", "kivi-2", "kivi-4", "pertoken-4"}
    for name in list_presets():
        rec = load_preset(name)
        assert rec.is_preset and rec.model is None
        rec.check_model(INFO)


def test_memory_accounting_matches_hand_computation():
    # kivi-2 at T=4096, S=0, R=128, G=32: flushed = (4096-128)//32*32 = 3968 tokens
    mem = load_preset("kivi-2").memory(INFO, 4096)
    per_layer_head = (128 * 64 * 2 * 2  # window K+V at 16 bit
                      + 3968 * 64 * 2 / 8 * 2  # K and V codes
                      + 3968 // 32 * 64 * 2 * 2  # K scale+zero per channel per group
                      + 3968 * (64 // 32) * 2 * 2)  # V scale+zero per token per group
    assert mem.total_bytes == pytest.approx(per_layer_head * 30 * 3)
    assert load_preset("fp16").memory(INFO, 4096).effective_bits == 16.0
    assert 3.0 < mem.effective_bits < 3.5


def test_round_trip(tmp_path):
    layers = [LayerConfig(k_bits=b, v_bits=4, v_group=16, window=64, sinks=4) for b in (2, 4, 8)]  # groups divide head_dim 16
    info = ModelInfo("m", "llama", 3, 4, 2, 16, 128, (None,) * 3, "abc")
    rec = Recipe(name="fit", layers=layers, model=info, tensors={"layers.0.k.clip": torch.full((2, 16), 0.9)},
                 provenance={"seed": 0})
    rec.save(tmp_path / "r.safetensors")
    back = Recipe.load(tmp_path / "r.safetensors")
    assert back.layers == layers and back.model == info and back.provenance == {"seed": 0}
    assert torch.equal(back.tensors["layers.0.k.clip"], rec.tensors["layers.0.k.clip"])


def test_refuses_recipe_for_another_model():
    info = ModelInfo("other", "qwen2", 30, 9, 3, 64, 8192, (None,) * 30, "ffff")
    rec = Recipe(name="fit", layers=[LayerConfig()] * 30, model=info)
    with pytest.raises(RecipeError, match="model_type"):
        rec.check_model(INFO)


@pytest.mark.parametrize("change, field", [
    ({"k_bits": 5}, "k_bits"), ({"v_bits": 1}, "v_bits"), ({"k_axis": "diag"}, "k_axis"),
    ({"window": 16, "k_bits": 2, "k_group": 32}, "window"), ({"sinks": -1}, "sinks"),
    ({"surprise": 1}, "unknown keys"),
])
def test_bad_layer_fields_are_named(tmp_path, change, field):
    doc = load_preset("kivi-2").metadata()
    doc["default_layer"] = {**doc["default_layer"], **change}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RecipeError, match=field):
        Recipe.load(path)


def test_group_must_divide_head_dim():
    rec = Recipe(name="x", default_layer=LayerConfig(k_bits=4, v_bits=4, v_group=48, window=128))
    with pytest.raises(RecipeError, match="v_group 48"):
        rec.check_model(INFO)


def test_wrong_schema_version(tmp_path):
    doc = load_preset("kivi-4").metadata() | {"schema_version": 99}
    save_file({}, str(tmp_path / "r.safetensors"), metadata={METADATA_KEY: json.dumps(doc)})
    with pytest.raises(RecipeError, match="schema_version"):
        Recipe.load(tmp_path / "r.safetensors")


def test_truncated_file(tmp_path):
    rec = Recipe(name="fit", layers=[LayerConfig()] * 2, tensors={"layers.0.k.clip": torch.ones(2, 8)})
    rec.save(tmp_path / "r.safetensors")
    data = (tmp_path / "r.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(RecipeError, match="corrupt or truncated"):
        Recipe.load(tmp_path / "t.safetensors")


def test_missing_file_and_unknown_preset(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        Recipe.load(tmp_path / "nope.safetensors")
    with pytest.raises(RecipeError, match="does not exist"):
        Recipe.load("kivi-3")


def test_nan_tensor_refused(tmp_path):
    rec = Recipe(name="fit", layers=[LayerConfig()], tensors={"layers.0.k.clip": torch.tensor([float("nan")])})
    rec.save(tmp_path / "r.safetensors")
    with pytest.raises(RecipeError, match="NaN"):
        Recipe.load(tmp_path / "r.safetensors")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400))
def test_fuzz_raw_bytes_only_raise_recipe_error(tmp_path, data):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(data)
    try:
        Recipe.load(path)
    except RecipeError:
        pass


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 300) | st.floats(allow_nan=True)
                           | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                           max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=st.dictionaries(st.sampled_from(["format", "schema_version", "name", "model", "layers",
                                                 "default_layer", "provenance", "extra"]), json_values, max_size=3),
       layer_patch=st.dictionaries(st.sampled_from(["k_bits", "v_bits", "k_axis", "k_group", "v_group", "sinks",
                                                    "window", "bogus"]), json_values, max_size=3))
def test_fuzz_documents_only_raise_recipe_error(tmp_path, mutation, layer_patch):
    doc = load_preset("kivi-2").metadata()
    doc["default_layer"] = {**doc["default_layer"], **layer_patch}
    doc.update(mutation)
    path = tmp_path / "fuzz.safetensors"
    save_file({}, str(path), metadata={METADATA_KEY: json.dumps(doc)})
    try:
        Recipe.load(path).check_model(INFO)
    except RecipeError:
        pass
