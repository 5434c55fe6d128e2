"""The error-bounded quantizer (kvcalib/methods/errbound.py, kvcalib.quant.uniform.quantize_fixed):
codes centred at zero with an error bound inside the grid, the step fit, the codec, the decode-
faithful simulation, the recipe and search switch, and its peaked code histogram."""

from __future__ import annotations

import pytest
import torch

from kvcalib.calibrate import fit_layer
from kvcalib.codec import LayerCodec
from kvcalib.export import ExportConfig, export_recipe
from kvcalib.layout import LayerConfig
from kvcalib.methods.errbound import DEFAULT_ALPHAS, ErrBoundMethod, fixed_params, step_errors
from kvcalib.methods.rotate import RotateMethod
from kvcalib.quant.huffman import symbol_histogram
from kvcalib.quant.packing import unpack_codes
from kvcalib.quant.uniform import dequantize, quantize_fixed, quantize_keys, quantize_values
from kvcalib.stats import CollectedStats
from tests.unit.parity import assert_costs_only_its_tensors, assert_decode_faithful
from tests.unit.test_calibrate import make_stats
from tests.unit.test_export import run_dir  # noqa: F401  (the shared statistics fixture)

CFG = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)


@pytest.mark.parametrize("per_channel", [True, False], ids=["keys-per-channel", "per-token"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fixed_grid_codes_are_centred_and_error_bounded(per_channel, bits):
    g = torch.Generator().manual_seed(bits)
    h, d, group = 2, 16, 8
    cols = d if per_channel else d // group
    step = torch.rand(h, cols, generator=g) * 0.3 + 0.1
    s16, z16 = fixed_params(step, bits)
    x = torch.randn(3, h, 16, d, generator=g) * 0.5  # (B, H, T, D)
    q = quantize_fixed(x, bits, group, per_channel, s16, z16)
    ref = (quantize_keys if per_channel else quantize_values)(x, bits, group)
    assert q.codes.shape == ref.codes.shape and q.scale.shape == ref.scale.shape  # the packed layout
    codes = unpack_codes(q.codes, bits).long()
    assert int(unpack_codes(quantize_fixed(torch.zeros_like(x), bits, group, per_channel, s16, z16).codes,
                            bits).unique().item()) == 1 << (bits - 1)  # zero -> the middle code
    col_step = s16.float()[None, :, None, :].repeat_interleave(1 if per_channel else group, -1)  # (1, H, 1, D)
    err = (dequantize(q) - x).abs()
    inside = (codes > 0) & (codes < (1 << bits) - 1)
    assert bool((err[inside] <= col_step.expand_as(err)[inside] / 2 + 1e-6).all())  # the bound inside the grid
    with pytest.raises(ValueError, match="scale16"):
        quantize_fixed(x, bits, group, per_channel, s16[:1], z16)


def test_fit_picks_the_step_with_the_least_error():
    g = torch.Generator().manual_seed(0)
    stats = make_stats(torch.randn(4, 32, 2, 16, generator=g), torch.randn(4, 32, 2, 16, generator=g) * 3)
    out = ErrBoundMethod().fit(stats, CFG)
    assert out["k.step"].shape == (2, 16) and out["v.step"].shape == (2, 2)
    x = stats.reservoir_v.float().transpose(1, 2)  # (NB, H, BL, D)
    rms, errs = step_errors(x, 2, 8, False)
    assert torch.allclose(out["v.step"], DEFAULT_ALPHAS[errs.index(min(errs))] * rms)
    assert ErrBoundMethod().fit(stats, LayerConfig()) == {}


def test_levels_are_not_fitted_on_a_fixed_grid():
    stats = make_stats(torch.randn(4, 32, 2, 16, generator=torch.Generator().manual_seed(1)))
    out = fit_layer(stats, CFG, ["errbound", "levels"])
    assert "v.step" in out and not any(k.endswith("levels") or k.endswith("levels_gain") for k in out)


def test_rotated_codes_are_peaked():
    """Rotated heavy-tailed values: the fixed grid's codes concentrate (lower entropy), the
    min/max groups' spread over the grid."""
    from kvcalib.methods.huffman import symbol_entropy

    g = torch.Generator().manual_seed(2)
    v = torch.randn(8, 64, 2, 32, generator=g)
    v[..., 5] *= 20.0
    stats = make_stats(v, v)
    cfg = LayerConfig(k_bits=16, v_bits=4, v_group=32, window=8)
    rot = fit_layer(stats, cfg, [RotateMethod(min_gain=-0.99), ErrBoundMethod()])
    codec = LayerCodec.from_tensors(cfg, rot)
    plain = LayerCodec.from_tensors(cfg, {k: t for k, t in rot.items() if "step" not in k})
    x = v.transpose(1, 2)  # (NB, H, BL, D)

    def entropy(c: LayerCodec) -> float:
        q = c.encode_values(x).quantized
        return symbol_entropy(symbol_histogram(unpack_codes(q.codes, 4), 4))

    assert entropy(codec) < entropy(plain) - 0.1  # measured 3.73 vs 3.94 bits at the least-error step


@pytest.fixture(scope="module")
def tiny(run_dir):
    out, model = run_dir
    return out, model, CollectedStats.load(out)


def test_simulation_matches_decode_and_the_recipe(tiny, tmp_path):
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point

    out, model, stats = tiny
    info = stats.model
    rec = assert_decode_faithful(model, stats, ["errbound"], CFG, "errbound")
    assert_costs_only_its_tensors(rec, info)  # parameters stored per group as before, plus the recipe's steps

    exported = export_recipe(out, tmp_path / "r.safetensors", ExportConfig(bits="k2v2", group=8, window=8,
                                                                         errbound=True))
    assert exported.name == "k2v2-g8-errbound" and exported.provenance["methods"] == ["errbound"]
    obj = SearchObjective(model, info, stats, torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1)),
                          context=256)
    fitted = obj.fitted_tensors(Point(8, 8, 0, (2, 2), (2, 2), (("errbound",), ())))
    assert "layers.0.k.step" in fitted and not any(k.startswith("layers.1.") for k in fitted)
