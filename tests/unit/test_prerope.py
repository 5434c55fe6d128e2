"""Pre-RoPE keys (kvcalib/methods/prerope.py): the RoPE arithmetic against transformers', what
collection records for it, the codec with the blocks' positions, the fit's decision, padding,
the recipe, accounting, export, inspect, the search switch, Huffman codebooks over it, the kernel
path's refusal, and the decode-faithful simulation against a token-by-token decode."""

from __future__ import annotations

import pytest
import torch

from kvcalib.calibrate import fit_stats
from kvcalib.codec import LayerCodec
from kvcalib.errors import KvcalibError
from kvcalib.export import ExportConfig, export_recipe
from kvcalib.layout import LayerConfig
from kvcalib.methods.base import CalibrationError, KernelAttend
from kvcalib.methods.prerope import PreRopeMethod, prerope_errors
from kvcalib.models import rope_tables
from kvcalib.quant.rotation import apply_rope
from kvcalib.quant.uniform import quantize_dequantize_keys
from kvcalib.recipe import Recipe
from kvcalib.stats import CollectedStats
from tests.conftest import tiny_model
from tests.unit.parity import assert_costs_only_its_tensors, assert_decode_faithful
from tests.unit.test_calibrate import make_stats
from tests.unit.test_export import run_dir  # noqa: F401  (the shared statistics fixture)

CFG = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)
ALWAYS = PreRopeMethod(min_gain=-0.99)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_rope_matches_transformers_and_inverts(arch):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model(arch)
    rope = rope_tables(model)[0]
    x = torch.randn(2, 2, 7, 16, generator=torch.Generator().manual_seed(0))  # (B, H, N, D)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6]])  # (B, N)
    emb = model.model.rotary_emb
    cos, sin = emb(x, pos) if arch != "gemma3" else emb(x, pos, model.config.layer_types[0])
    _, want = apply_rotary_pos_emb(x, x, cos, sin)
    assert float((apply_rope(x, pos, rope) - want).abs().max()) < 1e-5
    assert float((apply_rope(apply_rope(x, pos, rope), pos, rope, inverse=True) - x).abs().max()) < 1e-5


def test_partial_rotary_and_scaling():
    """Only the first R channels rotate; a cos/sin scaling a is undone by 1 / a**2."""
    rope = torch.tensor([1.0, 0.1, 2.0])  # R = 4 of 8 channels, scaling 2
    x = torch.randn(1, 1, 5, 8, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5)[None]
    y = apply_rope(x, pos, rope)
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert torch.allclose(y[..., :4].norm(dim=-1), 2.0 * x[..., :4].norm(dim=-1), atol=1e-5)
    assert torch.allclose(apply_rope(y, pos, rope, inverse=True), x, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit head_dim"):
        apply_rope(x[..., :2], pos, rope)


@pytest.fixture(scope="module")
def tiny(run_dir):
    out, model = run_dir
    return out, model, CollectedStats.load(out)


def test_collection_records_positions_and_rope(tiny):
    _, model, stats = tiny
    layer = stats.layers[0]
    assert layer.positions is not None and layer.positions.shape == (layer.reservoir_k.shape[0],)
    assert torch.equal(layer.rope, rope_tables(model)[0])
    # a block's keys are RoPE'd at its recorded positions: un-RoPE'd, two blocks of equal text agree
    assert set(layer.positions.tolist()) <= {0, 32}  # 64-token samples in 32-token blocks


def test_codec_needs_the_positions():
    rope = torch.tensor([1.0, 0.3, 0.1, 0.03, 1.0])  # head_dim 8
    codec = LayerCodec(LayerConfig(k_bits=4, v_bits=4, k_group=4, v_group=8, window=4), k_rope=rope)
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(100, 108)[None]  # (1, N)
    want = apply_rope(quantize_dequantize_keys(apply_rope(x, pos, rope, inverse=True), 4, 4), pos, rope)
    assert torch.equal(codec.roundtrip_keys(x, pos), want)
    with pytest.raises(KvcalibError, match="RoPE positions"):
        codec.roundtrip_keys(x)
    assert codec.kernel_attend("k", torch.device("cpu")) is None  # the decode kernel refuses the layer
    assert codec.kernel_attend("v", torch.device("cpu")) == KernelAttend()  # nothing to pass


def test_fit_measures_the_key_error_after_rope():
    """Keys whose pre-RoPE channels hold steady offsets: per-channel groups fit them before RoPE,
    after it every channel wanders with position."""
    g = torch.Generator().manual_seed(3)
    h, d, nb, bl = 2, 16, 4, 32
    rope = torch.cat([1.0 / (100.0 ** (torch.arange(0, d, 2).float() / d)), torch.ones(1)])
    pre = torch.randn(nb, bl, h, d, generator=g) * 0.1 + torch.randn(1, 1, h, d, generator=g) * 5
    positions = torch.tensor([0, 40, 200, 1000])
    pos = positions[:, None] + torch.arange(bl)[None]  # (NB, BL)
    post = apply_rope(pre.transpose(1, 2), pos, rope).transpose(1, 2)
    stats = make_stats(post)
    stats.rope, stats.positions = rope, positions
    plain, pre_err = prerope_errors(stats, 2, 8)
    assert pre_err < 0.5 * plain
    out = PreRopeMethod().fit(stats, CFG)
    assert float(out["k.prerope_gain"]) > 0.5 and torch.equal(out["k.rope"], rope)
    stats.positions = None
    with pytest.raises(CalibrationError, match="collect them again"):
        PreRopeMethod().fit(stats, CFG)
    assert PreRopeMethod().fit(stats, LayerConfig(v_bits=2, v_group=8, window=8)) == {}  # keys at 16 bits


def test_simulation_matches_token_by_token_decode(tiny):
    _, model, stats = tiny
    assert_decode_faithful(model, stats, [ALWAYS], CFG, "prerope")


def test_a_padded_row_decodes_like_the_row_alone(tiny):
    """Left padding shifts the RoPE positions (generate() counts real tokens only): the cache hands
    the codec those positions, so a padded row holds what the same prompt alone holds."""
    from kvcalib.runtime.cache import CompressedCache

    _, model, stats = tiny
    info = stats.model
    configs = [CFG] * info.num_layers
    rec = Recipe(name="pre", layers=configs, model=info, tensors=fit_stats(stats, configs, [ALWAYS]))
    g = torch.Generator().manual_seed(4)
    # padding of two flush blocks: the blocks hold the same tokens as the row alone, at slots 16 later
    long, short = torch.randint(1, 128, (40,), generator=g), torch.randint(1, 128, (24,), generator=g)
    ids = torch.stack([long, torch.cat([torch.zeros(16, dtype=torch.long), short])])
    mask = torch.ones_like(ids)
    mask[1, :16] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         past_key_values=CompressedCache.from_recipe(model, rec))
    alone = model.generate(short[None], max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           past_key_values=CompressedCache.from_recipe(model, rec))
    assert torch.equal(out[1, 40:], alone[0, 24:])


def test_recipe_export_inspect_search_and_codebooks(tiny, tmp_path):
    from kvcalib.inspect import inspect_recipe, method_lines
    from kvcalib.methods.huffman import layer_histograms
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point

    out, model, stats = tiny
    info = stats.model
    rec = export_recipe(out, tmp_path / "r.safetensors", ExportConfig(bits="k2v2", group=8, window=8, prerope=True))
    assert rec.name == "k2v2-g8-prerope" and rec.provenance["methods"] == ["prerope"]
    back = Recipe.load(tmp_path / "r.safetensors")
    for i in range(info.num_layers):
        assert (f"layers.{i}.k.rope" in back.tensors) == (float(back.tensors[f"layers.{i}.k.prerope_gain"]) > 0)
    report = inspect_recipe(str(tmp_path / "r.safetensors"))
    assert report["prerope"]["layers"] == info.num_layers
    assert any(line.startswith("pre-RoPE keys on") for line in method_lines(report))
    # the table is recipe state, counted once per layer that uses it; nothing per token
    configs = [CFG] * info.num_layers
    forced = Recipe(name="f", layers=configs, model=info, tensors=fit_stats(stats, configs, [ALWAYS]))
    assert_costs_only_its_tensors(forced, info)
    hists = layer_histograms(forced, stats)  # the reservoir's codes before RoPE, at its positions
    assert hists[(0, "k")].sum() > 0

    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    obj = SearchObjective(model, info, stats, ids, context=256)
    point = Point(8, 8, 0, (2, 2), (2, 2), (("prerope",), ()))
    fitted = obj.fitted_tensors(point)
    assert "layers.0.k.prerope_gain" in fitted and not any(k.startswith("layers.1.") for k in fitted)
    assert obj.kl(point) != obj.kl(Point(8, 8, 0, (2, 2), (2, 2), ((), ()))) or "layers.0.k.rope" not in fitted


def test_recipe_tensor_is_validated():
    assert PreRopeMethod.load({"k.rope": torch.tensor([1.0, 0.1, 1.0])}, CFG, 2, 16) is not None
    for bad, match in ((torch.tensor([1.0]), "R >= 2"), (torch.ones(10), "rotates 18 channels"),
                       (torch.tensor([1.0, -0.1, 1.0]), "positive")):
        with pytest.raises(ValueError, match=match):
            PreRopeMethod.load({"k.rope": bad}, CFG, 2, 16)
