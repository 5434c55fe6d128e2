"""Non-uniform levels (kvcalib/methods/levels.py and the quantizer's ``levels``): the reference
quantizer with levels, Lloyd-Max, the fit and its decision, the codec and its refusals, the
recipe, accounting, export, inspect, the search switch and the decode-faithful simulation."""

from __future__ import annotations

import pytest
import torch

from kvcalib.calibrate import fit_stats
from kvcalib.codec import LayerCodec
from kvcalib.errors import KvcalibError
from kvcalib.export import ExportConfig, export_recipe
from kvcalib.layout import LayerConfig
from kvcalib.methods.base import KernelAttend
from kvcalib.methods.levels import LevelsMethod, grid_error, lloyd_max
from kvcalib.methods.schedule import Schedule
from kvcalib.quant.uniform import (check_levels, code_units, decode, dequantize_values, encode, quantize_keys,
                                   quantize_values)
from kvcalib.recipe import Recipe
from kvcalib.stats import CollectedStats
from tests.unit.parity import assert_costs_only_its_tensors, assert_decode_faithful
from tests.unit.test_calibrate import make_stats
from tests.unit.test_export import run_dir  # noqa: F401  (the shared statistics fixture)

CFG = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)
ALWAYS = LevelsMethod(min_gain=-0.99)


def test_the_uniform_grid_as_levels_is_the_uniform_quantizer():
    x = torch.randn(2, 3, 16, 32, generator=torch.Generator().manual_seed(0))  # (B, H, N, D)
    for bits in (2, 4, 8):
        grid = torch.arange(1 << bits, dtype=torch.float32)
        for quantize in (quantize_keys, quantize_values):
            a, b = quantize(x, bits, 8), quantize(x, bits, 8, levels=grid)
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


def test_levels_encode_to_the_nearest_and_decode_by_lookup():
    levels = torch.tensor([0.2, 1.5, 2.0, 2.9])
    s, z = torch.tensor(2.0, dtype=torch.float16), torch.tensor(-1.0, dtype=torch.float16)
    t = torch.tensor([-3.0, 0.2, 0.85, 0.86, 1.75, 2.45, 5.0])  # code units; 0.85 and 1.75 are midpoints
    codes = encode(t * 2.0 - 1.0, s, z, 2, levels)
    assert codes.tolist() == [0, 0, 0, 1, 1, 2, 3]  # ties to the lower level, beyond the grid: end codes
    assert torch.equal(decode(codes, s, z, levels), levels[codes.long()] * 2.0 - 1.0)
    q = quantize_values(torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0)), 2, 8, levels=levels)
    on_grid = (dequantize_values(q, levels) - q.zero.float()) / q.scale.float()  # (1, 1, 4, 8) in code units
    assert ((on_grid[..., None] - levels).abs() < 1e-5).any(-1).all()  # every value sits on a level
    for bad, match in ((torch.tensor([0.0, 1.0, 1.0, 2.0]), "increasing"), (torch.arange(8.0), r"\(4,\)"),
                       (torch.tensor([0.0, 1.0, float("nan"), 3.0]), "finite")):
        with pytest.raises(ValueError, match=match):
            check_levels(bad, 2)


def test_lloyd_max_pins_the_ends_and_moves_the_inner_levels():
    """A uniform density on [0, 3] keeps the uniform grid (with the ends pinned it is the fixed
    point: the inner levels are their cells' means); a density peaked in the middle pulls the
    inner levels toward it and lowers the error, the ends staying on the group's min and max."""
    t = torch.linspace(0, 3, 200001)
    lv = lloyd_max(t, torch.ones_like(t), 2)
    assert torch.allclose(lv, torch.arange(4.0), atol=2e-3)
    peaked = torch.randn(100000, generator=torch.Generator().manual_seed(1)).clamp(-3, 3) * 0.5 + 1.5
    w = torch.ones_like(peaked)
    fit = lloyd_max(peaked, w, 2)
    assert fit[0] == 0 and fit[-1] == 3 and 1.0 < fit[1] < fit[2] < 2.0
    assert grid_error(peaked, w, fit) < 0.95 * grid_error(peaked, w, torch.arange(4.0))
    fit4 = lloyd_max(peaked * 5, w, 4)
    assert fit4[0] == 0 and fit4[-1] == 15 and bool((fit4[1:] > fit4[:-1]).all())


def test_code_units_are_the_encoders_view():
    x = torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(2))
    t, s = code_units(x, 4, 8, per_channel=True)
    q = quantize_keys(x, 4, 8)
    assert torch.equal(torch.round(t).clamp(0, 15).to(torch.uint8),
                       encode(x.reshape(2, 2, 2, 8, 8), q.scale[..., None, :], q.zero[..., None, :], 4).reshape(2, 2, 16, 8))
    assert torch.equal(s[:, :, :8], q.scale[:, :, :1].float().expand(2, 2, 8, 8))


def _peaked_stats(seed: int = 0):
    """Values with heavy tails (a few large tokens per group): the grid wastes levels at the ends."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(4, 32, 2, 16, generator=g)
    v = torch.randn(4, 32, 2, 16, generator=g) ** 3
    return make_stats(k, v, seed=seed)


def test_fit_keeps_levels_where_they_pay():
    stats = _peaked_stats()
    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=16, window=8)
    out = LevelsMethod().fit(stats, cfg)
    assert float(out["v.levels_gain"]) > 0.1 and out["v.levels"].shape == (16,)
    assert out["k.levels"].shape == (4,)
    plain = LevelsMethod(weighting="none").fit(stats, cfg)
    assert not torch.equal(plain["k.levels"], out["k.levels"]), "the attention weights move the levels"
    assert "v.levels" not in LevelsMethod(min_gain=0.99).fit(stats, cfg)
    assert LevelsMethod().fit(stats, LayerConfig(k_bits=8, v_bits=8, k_group=8, v_group=16, window=8)) == {}
    with pytest.raises(ValueError, match="weighting"):
        LevelsMethod(weighting="fisher")


def test_codec_applies_the_levels_and_refuses_kernels_and_tiers():
    levels = torch.tensor([0.1, 1.2, 1.9, 2.8])
    codec = LayerCodec(CFG, v_levels=levels)
    x = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(codec.roundtrip_values(x), dequantize_values(quantize_values(x, 2, 8, levels=levels), levels))
    assert not torch.equal(codec.roundtrip_values(x), LayerCodec(CFG).roundtrip_values(x))
    assert codec.kernel_attend("v", torch.device("cpu")) is None and codec.kernel_attend("k", torch.device("cpu")) == KernelAttend()
    cfg4 = LayerConfig(k_bits=4, v_bits=4, k_group=8, v_group=8, window=8)
    with pytest.raises(KvcalibError, match="schedule"):
        LayerCodec(cfg4, v_levels=torch.arange(16.0), schedule=Schedule.from_layer(cfg4, (64,)))


@pytest.fixture(scope="module")
def tiny(run_dir):
    out, model = run_dir
    return out, model, CollectedStats.load(out)


def test_simulation_matches_token_by_token_decode(tiny):
    _, model, stats = tiny
    assert_decode_faithful(model, stats, [ALWAYS], CFG, "levels")


def test_recipe_export_inspect_accounting_and_search(tiny, tmp_path):
    from kvcalib.inspect import inspect_recipe, method_lines
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point

    out, model, stats = tiny
    info = stats.model
    rec = export_recipe(out, tmp_path / "r.safetensors", ExportConfig(bits="k2v2", group=8, window=8, levels=True))
    assert rec.name == "k2v2-g8-levels" and rec.provenance["methods"] == ["levels"]
    report = inspect_recipe(str(tmp_path / "r.safetensors"))
    assert report["levels"]["layers"] == info.num_layers
    assert any(line.startswith("non-uniform levels") for line in method_lines(report))
    configs = [CFG] * info.num_layers
    forced = Recipe(name="f", layers=configs, model=info, tensors=fit_stats(stats, configs, [ALWAYS]))
    assert_costs_only_its_tensors(forced, info)  # a few floats per layer
    with pytest.raises(Exception, match=r"layers\.0\.v\.levels"):
        Recipe(name="bad", layers=configs, model=info,
               tensors={"layers.0.v.levels": torch.arange(8.0)}).codecs(info)

    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    obj = SearchObjective(model, info, stats, ids, context=256)
    point = Point(8, 8, 0, (2, 2), (2, 2), (("levels",), ()))
    fitted = obj.fitted_tensors(point)
    assert "layers.0.v.levels_gain" in fitted and not any(k.startswith("layers.1.") for k in fitted)
