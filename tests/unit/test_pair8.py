"""8-bit scale and zero per group (kvcalib/quant/pair8.py, kvcalib/methods/scale8.py): the format's
error against float16 pairs, its bytes, its rounding (no group's extremes clamp), the fit, the codec
(reference path, refusals), the decode-faithful simulation, the memory accounting, the recipe, the
export flag and the search switch."""

from __future__ import annotations

import pytest
import torch

from kvcalib.calibrate import fit_layer
from kvcalib.codec import LayerCodec
from kvcalib.errors import KvcalibError
from kvcalib.export import ExportConfig, export_recipe
from kvcalib.layout import LayerConfig
from kvcalib.methods.scale8 import Scale8Method
from kvcalib.quant.packing import unpack_codes
from kvcalib.quant.pair8 import Pair8, fit_pair8, pair_floats
from kvcalib.errors import CalibrationError
from kvcalib.quant.uniform import dequantize, dequantize_keys, quantize_keys, quantize_values, requantize
from kvcalib.recipe import Recipe
from tests.unit.parity import assert_decode_faithful
from tests.unit.test_calibrate import make_stats
from tests.unit.test_errbound import tiny  # noqa: F401  (the run folder, its model and statistics)
from tests.unit.test_export import run_dir  # noqa: F401  (the shared statistics fixture)

CFG = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)


def _data(seed: int, nb: int, h: int = 2, t: int = 64, d: int = 32) -> torch.Tensor:
    """(NB, H, T, D): channels of different scales and offsets, as keys have; the channels' offsets
    are the model's (the same for every seed), the tokens differ."""
    offsets = torch.randn(d, generator=torch.Generator().manual_seed(100))  # (D,)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, h, t, d, generator=g) * torch.linspace(0.2, 3.0, d) + offsets


@pytest.mark.parametrize("per_channel", [True, False], ids=["keys-per-channel", "per-token"])
@pytest.mark.parametrize("bits,within", [(2, 1.02), (3, 1.04), (4, 1.15)])
def test_the_pair_costs_little_error_and_two_bytes_a_group_less(per_channel, bits, within):
    """Held-out groups on tables fitted on other data: reconstruction error within 2-15% of float16
    pairs' (measured keys / values 1.004 / 1.012 at 2 bits, 1.016 / 1.026 at 3, 1.096 / 1.107 at 4,
    where the zero's step is half a scale: the price of its reach, kvcalib/quant/pair8.py), codes
    from the decoded floats, one byte each for scale and zero."""
    group = 8
    pair = fit_pair8(_data(0, 4), bits, group, per_channel)
    x = _data(1, 2)  # (B, H, T, D), held out
    quantize = quantize_keys if per_channel else quantize_values
    q8, q16 = quantize(x, bits, group, pair=pair), quantize(x, bits, group)
    assert q8.pair8 and q8.scale.dtype == torch.uint8 and q8.zero.dtype == torch.int8 and not q16.pair8
    assert q8.scale.shape == q16.scale.shape and q8.codes.shape == q16.codes.shape  # the same packed layout
    assert q16.nbytes() - q8.nbytes() == 2 * q16.scale.numel()
    err8 = float(((dequantize(q8, pair=pair) - x) ** 2).mean())
    err16 = float(((dequantize(q16) - x) ** 2).mean())
    assert err16 < err8 < within * err16
    with pytest.raises(ValueError, match="needs the side's pair tables"):
        dequantize(q8)
    with pytest.raises(ValueError, match="float16 scale/zero"):
        dequantize(q16, pair=pair)


def test_no_group_extreme_leaves_the_code_range():
    """Nearest rounding steps the exponent up where a group's minimum or maximum would need a code
    outside 0..qmax: every group's extremes decode within half a scale, a wide group (past the
    grid's top) included only up to the top."""
    bits, group = 2, 8
    x = _data(2, 2)  # (B, H, T, D)
    pair = fit_pair8(x, bits, group, True)
    q = quantize_keys(x, bits, group, pair=pair)
    s, z = pair_floats(q.scale, q.zero, bits, pair)  # (B, H, T/G, D)
    xg = x.reshape(2, 2, 64 // group, group, 32)
    lo, hi = xg.amin(3), xg.amax(3)
    assert bool(((lo - z) / s >= -0.5).all()) and bool(((hi - z) / s <= 3.5).all())
    codes = unpack_codes(q.codes, bits).reshape(2, 2, 64 // group, group, 32)
    assert int(codes.amin(3).min()) == 0 and int(codes.amax(3).max()) == 3


def test_tables_are_checked():
    with pytest.raises(ValueError, match="positive"):
        Pair8(torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="differ in shape"):
        Pair8(torch.ones(2, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="do not fit"):
        quantize_keys(_data(3, 1), 2, 8, pair=Pair8(torch.ones(3, 32), torch.zeros(3, 32)))  # 2 kv heads, not 3


def test_fit_load_and_refusals():
    g = torch.Generator().manual_seed(4)
    stats = make_stats(torch.randn(4, 32, 2, 16, generator=g), torch.randn(4, 32, 2, 16, generator=g) * 3)
    out = Scale8Method().fit(stats, CFG)
    assert out["k.pair_base"].shape == (2, 16) and out["v.pair_base"].shape == (2, 2)  # (H, C): C = D, D / group
    assert Scale8Method().fit(stats, LayerConfig()) == {}  # 16-bit layers store no pairs
    codec = LayerCodec.from_tensors(CFG, out, 2, 16)
    assert codec.state("scale8") is not None
    assert codec.kernel_attend("k", torch.device("cpu")) is None  # the decode kernel reads float16 pairs only
    with pytest.raises(ValueError, match="come together"):
        LayerCodec.from_tensors(CFG, {"k.pair_base": out["k.pair_base"]}, 2, 16)
    with pytest.raises(ValueError, match=r"\(H, C\) = \(2, 16\)"):
        LayerCodec.from_tensors(CFG, {"k.pair_base": out["k.pair_base"][:, :8],
                                      "k.pair_centre": out["k.pair_centre"][:, :8]}, 2, 16)
    both = fit_layer(stats, CFG, ["errbound", "scale8"])  # a fixed grid keeps one pair per column: no tables
    assert "v.step" in both and not any("pair" in k for k in both)
    with pytest.raises(KvcalibError, match="keep one"):
        LayerCodec.from_tensors(CFG, {**both, "v.pair_base": out["v.pair_base"], "v.pair_centre": out["v.pair_centre"]},
                                2, 16)
    blk = codec.encode_keys(stats.reservoir_k[:, :32].float().transpose(1, 2))  # (NB, H, 32, D)
    q4 = quantize_keys(torch.randn(1, 2, 8, 16), 4, 8, pair=fit_pair8(torch.randn(1, 2, 8, 16), 4, 8, True))
    with pytest.raises(CalibrationError, match="cannot be requantized"):
        requantize(q4, 2)  # its tables belong to its bits
    assert torch.equal(dequantize_keys(blk.quantized, pair=codec.state("scale8").pair8("k")),
                       dequantize_keys(blk.quantized, pair=Pair8(out["k.pair_base"], out["k.pair_centre"])))


def test_simulation_matches_decode_and_the_bytes_are_counted(tiny, tmp_path):
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point

    out, model, stats = tiny
    info = stats.model
    rec = assert_decode_faithful(model, stats, ["scale8"], CFG, "scale8")
    plain = Recipe(name="plain", layers=rec.layers, model=info)
    mine, theirs = rec.memory(info, 256).components, plain.memory(info, 256).components
    for side in ("k", "v"):  # one byte a scale and one a zero: half the float16 pairs' bytes
        assert mine[f"{side}_scales"] == pytest.approx(theirs[f"{side}_scales"] / 2)
    tables = sum(t.numel() * t.element_size() for t in rec.tensors.values())
    assert mine["recipe_state"] == pytest.approx(theirs.get("recipe_state", 0.0) + tables)

    exported = export_recipe(out, tmp_path / "r.safetensors", ExportConfig(bits="k2v2", group=8, window=8,
                                                                         scale8=True))
    assert exported.provenance["methods"] == ["scale8"] and "scale8" in exported.name
    assert Recipe.load(tmp_path / "r.safetensors").codecs(info)[0].state("scale8") is not None
    obj = SearchObjective(model, info, stats, torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1)),
                          context=256)
    fitted = obj.fitted_tensors(Point(8, 8, 0, (2, 2), (2, 2), (("scale8",), ())))
    assert "layers.0.k.pair_base" in fitted and not any(k.startswith("layers.1.") for k in fitted)
