"""experiments/scale8.py's 8-bit scale/zero formats on tiny tensors: each stores what its format can
hold, the codes recomputed from the rounded parameters never leave 0..qmax (no clamping needed), the
round trip is within half a stored scale, the scale stays within its grid's rounding of the group's
range, and the float16 path is the shipped quantizer bit for bit."""

from __future__ import annotations

import pytest
import torch

from experiments import scale8 as s8
from kvcalib.quant.uniform import quantize_dequantize_keys, quantize_dequantize_values

H, T, D, G = 2, 128, 64, 64


def _kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with per-channel offsets up to +-40 (the outlier channels per-channel keys have; the same
    channels in every draw, as a model's are), a constant channel and a near-constant one; values of
    mixed magnitudes, one all-zero token."""
    shape = torch.Generator().manual_seed(123)
    spread, offset = torch.rand(1, 1, D, generator=shape) * 3, (torch.rand(1, 1, D, generator=shape) - 0.5) * 80
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(H, T, D, generator=g) * spread + offset
    k[:, :, 3] = 1.25
    k[:, :, 5] = 7.0 + 1e-4 * torch.randn(H, T, generator=g)
    v = torch.randn(H, T, D, generator=g) * torch.rand(H, T, 1, generator=g) * 2
    v[:, 7] = 0.0
    return k, v


def _calib(x: torch.Tensor, side: str, bits: int) -> dict:
    return s8.calibrate(x, side, bits, G)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("fmt", s8.FORMATS)
def test_codes_stay_in_range_and_error_within_half_a_scale(fmt, side, bits):
    k, v = _kv()
    x = k if side == "k" else v
    calib = _calib(_kv(1)[0 if side == "k" else 1], side, bits)  # calibrated on other data, as the run does
    xh, info = s8.quantize(x, side, bits, G, fmt, calib)
    if fmt in s8.EIGHT_BIT:
        assert info["out_of_range"] == 0  # codes from the rounded parameters needed no clamping
    assert info["clipped_groups"] == 0
    # half a stored scale per element: recompute the stored parameters the same way
    qmax = (1 << bits) - 1
    xg, dim = s8.group_view(x, side, G)
    lo, hi = xg.amin(dim=dim, keepdim=True), xg.amax(dim=dim, keepdim=True)
    if fmt in ("fp16", "fp32"):
        # the shipped format does not promise coverage: its error bound has the float16 rounding of
        # the zero and of qmax * scale beyond the group's ends (kvcalib.quant.uniform's docstring)
        s, z, _ = s8.params_fp(lo, hi, qmax, fmt == "fp16")
        over = (z - lo).clamp_min(0) + (hi - z - qmax * s).clamp_min(0)
        bound = (s / 2 + over).expand_as(xg).reshape(x.shape)
        assert bool(((xh - x).abs() <= bound * (1 + 1e-5) + 1e-5).all())
        return
    elif fmt.startswith("e4m3"):
        s, z, _ = s8.params_e4m3(lo, hi, qmax, nearest=fmt == "e4m3-n")
        # both are float8_e4m3fn values
        assert torch.equal(s.to(torch.float8_e4m3fn).float(), s) and torch.equal(z.to(torch.float8_e4m3fn).float(), z)
        if fmt == "e4m3":  # covering: the grid holds the group's range
            assert bool((z <= lo).all()) and bool((z.double() + qmax * s.double() >= hi.double()).all())
    else:
        spec = s8.LOG_FORMATS[fmt]
        base, centre = calib[fmt]["base"], calib[fmt]["centre"]
        step = spec["zero_step"](qmax)
        s, z, _ = s8.params_log8(lo, hi, qmax, base, centre, step, spec["octave_steps"], spec["nearest"])
        # a uint8 exponent on the grid and an int8 zero offset
        e = torch.log2(s.double() / base.double()) * spec["octave_steps"]
        assert torch.allclose(e, e.round(), atol=1e-3) and bool((e.round() >= 0).all() & (e.round() <= 255).all())
        # the zero is the decoder's float32 centre + m * (scale * step) for an int8 m
        m = ((z.double() - centre.double()) / (s.double() * step)).round()
        decoded = [(centre.float() + (m + d).clamp(-128, 127).float() * (s * step)) for d in (-1, 0, 1)]
        assert bool((sum((z == dz).int() for dz in decoded) > 0).all())
        if not spec["nearest"]:
            assert bool((z <= lo).all()) and bool((z.double() + qmax * s.double() >= hi.double()).all())
        # the scale is the group's need rounded on the grid (two steps of slack for float rounding),
        # or the grid's smallest value: the need is the range, or what the int8 zero's reach asks
        range_need = (hi - lo).double() / (qmax - (0 if spec["nearest"] else step))
        reach = torch.maximum((centre - lo).double() / (128 * step), (lo - centre).double() / (127 * step))
        need = torch.maximum(range_need, reach)
        limit = torch.maximum(need * 2 ** (2 / spec["octave_steps"]), base.double().expand_as(need)) * (1 + 1e-6)
        assert bool((s.double() <= limit).all())
    err = (xh - x).abs()
    half = (s / 2).expand_as(xg).reshape(x.shape)
    assert bool((err <= half * (1 + 1e-5) + 1e-6).all())


def test_fp16_path_is_the_shipped_quantizer():
    k, v = _kv()
    for bits in (2, 3, 4):
        assert torch.equal(s8.quantize(k, "k", bits, G, "fp16")[0], quantize_dequantize_keys(k, bits, G))
        assert torch.equal(s8.quantize(v, "v", bits, G, "fp16")[0], quantize_dequantize_values(v, bits, G))


def test_e4m3_rounding_directions():
    x = torch.tensor([0.3, -0.3, 1.0, 447.0, -5.1, 0.0])
    lo, up = s8.e4m3_floor(x), s8.e4m3_ceil(x)
    assert bool((lo <= x.double()).all()) and bool((up >= x.double()).all())
    assert torch.equal(s8.e4m3_floor(torch.tensor([1.0])), torch.tensor([1.0], dtype=torch.float64))
    assert float(s8.e4m3_ceil(torch.tensor([447.0]))[0]) == 448.0
