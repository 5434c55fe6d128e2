"""Adding a method is one file: the toy method of ``toy_method.py``, registered here, is fitted,
saved, loaded, validated, accounted, searched, decoded and exported with its CLI flag, with no
other file of kvcalib naming it (issue 32's done-when)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcalib import methods
from kvcalib.calibrate import fit_stats
from kvcalib.codec import LayerCodec
from kvcalib.errors import RecipeError
from kvcalib.export import ExportConfig, export_recipe
from kvcalib.layout import LayerConfig
from kvcalib.models import model_info
from kvcalib.quant.uniform import quantize_dequantize_keys, quantize_dequantize_values
from kvcalib.recipe import Recipe
from kvcalib.simulate import simulated_logits
from kvcalib.stats import CollectedStats
from tests.unit.test_cache import decode_logits
from tests.unit.test_export import run_dir  # noqa: F401  (the shared statistics fixture)
from tests.unit.toy_method import EqualizeMethod

ROOT = Path(__file__).resolve().parents[2]
CFG = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)


@pytest.fixture
def toy():
    methods.register(EqualizeMethod)
    yield EqualizeMethod
    methods.unregister(EqualizeMethod.name)


@pytest.fixture(scope="module")
def toy_run(run_dir):  # noqa: F811  (the fixture, by name)
    """test_export's statistics of a tiny llama (run folder, model) and the statistics loaded."""
    out, model = run_dir
    return out, model, CollectedStats.load(out)


def test_unregistered_toy_is_unknown_everywhere():
    assert "equalize" not in methods.registry()
    rec = Recipe(name="x", layers=[CFG], tensors={"layers.0.k.equalize": torch.ones(4, 16)})
    with pytest.raises(RecipeError, match="equalize"):
        rec.codecs(num_layers=1)


def test_toy_is_fitted_saved_loaded_and_validated(toy, toy_run, tmp_path):
    out, model, stats = toy_run
    info = stats.model
    tensors = fit_stats(stats, [CFG] * info.num_layers, ["equalize"])
    assert sorted(tensors) == [f"layers.{i}.{s}.equalize" for i in range(info.num_layers) for s in "kv"]
    scale = tensors["layers.0.k.equalize"]
    assert scale.shape == (info.num_kv_heads, info.head_dim) and torch.equal(torch.exp2(torch.log2(scale).round()), scale)

    path = tmp_path / "toy.safetensors"
    rec = export_recipe(out, path, ExportConfig(bits="k2v2", group=8, window=8, equalize=True))
    assert rec.name == "k2v2-g8-equalize" and rec.provenance["methods"] == ["equalize"]
    back = Recipe.load(path)
    assert all(torch.equal(back.tensors[k], rec.tensors[k]) for k in rec.tensors)
    assert [c.state("equalize") is not None for c in back.codecs(info)] == [True] * info.num_layers

    bad = Recipe(name="bad", layers=back.layers, model=info,
                 tensors={**back.tensors, "layers.1.v.equalize": torch.ones(info.num_kv_heads, 3)})
    with pytest.raises(RecipeError, match=r"layers\.1\.v\.equalize must have shape"):
        bad.codecs(info)


def test_toy_bytes_are_accounted(toy, toy_run):
    _, _, stats = toy_run
    info = stats.model
    plain = Recipe(name="plain", layers=[CFG] * info.num_layers, model=info)
    toyed = Recipe(name="toy", layers=[CFG] * info.num_layers, model=info,
                   tensors=fit_stats(stats, [CFG] * info.num_layers, ["equalize"]))
    mem, base = toyed.memory(info, 256), plain.memory(info, 256)
    tables = 2.0 * info.num_kv_heads * info.head_dim * 2 * info.num_layers  # fp16, K and V, every layer
    assert mem.components["equalize_tables"] == tables
    assert mem.total_bytes == base.total_bytes + tables + sum(t.numel() * 4 for t in toyed.tensors.values())
    assert toyed.memory(info, 4).components.get("equalize_tables") is None  # nothing packed yet: no tables


def test_toy_transform_is_applied_by_the_codec_and_decodes_as_simulated(toy, toy_run):
    _, model, stats = toy_run
    info = stats.model
    h, d = info.num_kv_heads, info.head_dim
    scale = torch.exp2(torch.randint(-3, 4, (h, d)).float())  # (H, D)
    x = torch.randn(1, h, 16, d) * scale[None, :, None, :]  # (B, H, N, D) channels of unequal range
    codec = LayerCodec(CFG, k_equalize=scale, v_equalize=scale)
    s = scale[None, :, None, :]
    assert torch.equal(codec.roundtrip_keys(x), quantize_dequantize_keys(x / s, 2, 8) * s)
    assert torch.equal(codec.roundtrip_values(x), quantize_dequantize_values(x / s, 2, 8) * s)
    assert codec.kernel_attend("k", torch.device("cpu")) is None  # the kernels do not know it: reference path

    configs = [CFG] * info.num_layers
    rec = Recipe(name="toy", layers=configs, model=info, tensors=fit_stats(stats, configs, ["equalize"]))
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    dec, _ = decode_logits(model, ids, rec, 1)
    sim = simulated_logits(model, ids, configs, rec.codecs(info), prompt_len=1)
    assert float((sim - dec).abs().max()) < 1e-3
    plain, _ = decode_logits(model, ids, Recipe(name="plain", layers=configs, model=info), 1)
    assert float((plain - dec).abs().max()) > 1e-3, "the toy transform changes what is decoded"


def test_toy_is_a_search_switch(toy, toy_run, tmp_path):
    from kvcalib.optimize import SearchConfig, search_with
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point, SearchSpace

    _, model, stats = toy_run
    info = model_info(model.config, "tiny")
    space = SearchSpace(groups=(8,), windows=(8,), sinks=(0,), layer_methods=("equalize", "clip"))
    assert space.layer_methods == ("clip", "equalize")  # pipeline order
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    obj = SearchObjective(model, stats.model, stats, ids, context=256)
    point = Point(8, 8, 0, (2, 2), (2, 2), (("equalize",), ()))
    fitted = obj.fitted_tensors(point)
    assert "layers.0.k.equalize" in fitted and not any(k.startswith("layers.1.") for k in fitted)
    on, off = obj.kl(point), obj.kl(Point(8, 8, 0, (2, 2), (2, 2), ((), ())))
    assert on != off
    cfg = SearchConfig(out=tmp_path / "run", trials=4, budget_bits=16.0, eval=False, presets=("kivi-2",),
                       context=256, space={"groups": [8], "windows": [8], "sinks": [0], "layer_methods": ["equalize"]})
    (tmp_path / "run").mkdir()
    doc = search_with(cfg, model, info, stats, ids, tmp_path / "run", progress=False)
    assert doc["space"]["layer_methods"] == ["equalize"]
    assert any(any("equalize" in m for m in t["point"]["methods"]) for t in doc["trials"] if t.get("point"))


def test_toy_flag_on_the_command_line(toy_run, tmp_path):
    """A process that registers the toy before the CLI is built gets ``kvcalib export --equalize``."""
    out, _, _ = toy_run
    path = tmp_path / "cli.safetensors"
    code = ("import sys; from kvcalib import methods; from tests.unit.toy_method import EqualizeMethod; "
            "methods.register(EqualizeMethod); from kvcalib.cli import main; "
            f"sys.argv = ['kvcalib', 'export', {str(out)!r}, '-o', {str(path)!r}, '--bits', 'k2v2', '--group', '8', "
            "'--window', '8', '--equalize']; main()")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with pytest.raises(RecipeError, match="equalize is not a tensor any method"):
        Recipe.load(path)  # loading validates every tensor: without the toy registered, its tensor is refused
    methods.register(EqualizeMethod)
    try:
        rec = Recipe.load(path)
    finally:
        methods.unregister(EqualizeMethod.name)
    assert any(k.endswith(".equalize") for k in rec.tensors) and "equalize" in json.dumps(rec.provenance)
    help_text = subprocess.run([sys.executable, "-m", "kvcalib.cli", "export", "--help"], cwd=ROOT,
                               capture_output=True, text=True).stdout
    assert "--equalize" not in help_text  # an unregistered toy adds nothing


def test_kernel_arguments_are_typed_and_each_field_is_one_methods():
    """Method states hand the kernels a typed value (issue 52 item 4): a state fills its own fields,
    the codec merges a layer's states, and two methods setting one field is an error naming both;
    the decode kernel's keyword arguments come from one place, set fields only."""
    from kvcalib.errors import KvcalibError
    from kvcalib.methods.base import KernelAttend, KernelEncode

    perm = torch.stack([torch.randperm(16) for _ in range(2)]).int()
    rot = (torch.eye(16), None)
    merged = KernelAttend.merge({"reorder": KernelAttend(perm=perm), "rotate": KernelAttend(rot=rot)})
    assert merged.perm is perm and merged.rot is rot
    assert merged.kernel_args("v") == {"v_perm": perm, "v_rot": rot} and KernelAttend().kernel_args("k") == {}
    with pytest.raises(KvcalibError, match="'reorder' and 'toy'"):
        KernelAttend.merge({"reorder": KernelAttend(perm=perm), "toy": KernelAttend(perm=perm)})
    with pytest.raises(KvcalibError, match="'center' and 'toy'"):
        KernelEncode.merge({"center": KernelEncode(mean=torch.zeros(1), center=8), "toy": KernelEncode(center=16)})
    x1, x2 = torch.zeros(1), torch.ones(1)  # a transform run at flush: a later state's block replaces it
    assert KernelEncode.merge({"prerope": KernelEncode(x=x1), "rotate": KernelEncode(x=x2)}).x is x2
    # a layer's codec: SKVQ's permutation and a rotation, each its own field
    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=8, window=8)
    from kvcalib.quant.rotation import hadamard

    codec = LayerCodec(cfg, v_perm=perm, v_rotate=(hadamard(16), None))
    attend = codec.kernel_attend("v", torch.device("cpu"))
    assert isinstance(attend, KernelAttend) and torch.equal(attend.perm, perm) and attend.rot is not None
