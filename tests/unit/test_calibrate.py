"""Calibration steps on synthetic data with planted structure (reorder, clip, center, outliers, schedule).

Exactness where the operation is exact (permutations, q.k invariance, requantization onto a
coarser grid that holds the values, mantissa truncation, byte counts: ``torch.equal`` / ``==``);
lossy fits are checked by comparing errors (the fitted choice must beat the naive one), never
by a loose allclose.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kvcalib.calibrate import CalibrationError, build_methods, fit_layer, fit_stats
from kvcalib.methods import registry

METHODS = registry()
from kvcalib.methods.base import Method, fake_quantize, validate_layer_stats
from kvcalib.methods.center import (
    CenterMethod,
    center,
    centering_errors,
    fit_centering_gain,
    mean_bits_per_element,
    mean_bytes_per_token,
    quantize_mean,
    uncenter,
)
from kvcalib.methods.clip import DEFAULT_GRID, choose_alpha, clip_errors, fit_clip_alpha
from kvcalib.methods.outliers import (
    OutlierMethod,
    OutlierState,
    default_pool_sizes,
    outlier_gain,
    pool_bytes,
    select_outliers,
    trace_outliers,
)
from kvcalib.methods.reorder import (
    ReorderMethod,
    apply_perm,
    channel_features,
    channel_features_from_tokens,
    check_perm,
    fit_channel_permutation,
    invert_perm,
)
from kvcalib.methods.schedule import (
    PRESETS,
    Schedule,
    Tier,
    fake_quantize_chain,
    mantissa_truncate,
    preset_schedule,
    requantize,
    schedule_bytes,
    tier_token_counts,
    truncated_width,
)
from kvcalib.errors import KvcalibError
from kvcalib.models import ModelInfo
from kvcalib.quant.uniform import (
    dequantize,
    dequantize_keys,
    dequantize_values,
    quantize_dequantize_values,
    quantize_keys,
    quantize_values,
)
from kvcalib.layout import LayerConfig, layer_bytes
from kvcalib.stats import CollectedStats, LayerStats, RunningChannelStats


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _moments(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Streamed statistics of reservoir-shaped tokens x (NB, BL, H, D)."""
    r = RunningChannelStats(x.shape[2], x.shape[3])
    r.update(x.reshape(-1, x.shape[2], x.shape[3]))
    return r.tensors()


def make_stats(k: torch.Tensor, v: torch.Tensor | None = None, q: torch.Tensor | None = None,
               rep: int = 2, seed: int = 0) -> LayerStats:
    """LayerStats from token blocks k/v (NB, BL, H, D) and queries (NB, BL, H * rep, D), with a
    RoPE table (theta 10000 over all D channels) and blocks recorded at positions 0, BL, 2 BL..."""
    nb, bl, h, d = k.shape
    v = k.clone() if v is None else v
    q = torch.randn(nb, bl, h * rep, d, generator=_gen(seed + 99)) if q is None else q
    rope = torch.cat([1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)), torch.ones(1)])
    return LayerStats(k=_moments(k), v=_moments(v), reservoir_k=k.half(), reservoir_v=v.half(),
                      reservoir_q=q.half(), scaling=d**-0.5, rope=rope, positions=torch.arange(nb) * bl)


def default_stats(h: int = 2, d: int = 16, nb: int = 3, bl: int = 32, seed: int = 0) -> LayerStats:
    g = _gen(seed)
    scales = torch.linspace(0.2, 4.0, d)[torch.randperm(d, generator=g)]  # (D,) varied channel scales
    k = torch.randn(nb, bl, h, d, generator=g) * scales
    v = torch.randn(nb, bl, h, d, generator=g) * scales.flip(0)
    return make_stats(k, v, seed=seed)


CFG = LayerConfig(k_bits=2, v_bits=2, k_axis="channel", k_group=8, v_group=4, sinks=2, window=8)
CFG_TOKEN_K = LayerConfig(k_bits=4, v_bits=2, k_axis="token", k_group=4, v_group=4, sinks=0, window=8)

# expected shape of every tensor the registry may produce, for (H, D)
SHAPES = {
    "k.perm": lambda h, d: (h, d), "v.perm": lambda h, d: (h, d),
    "k.clip": lambda h, d: (h, 1), "v.clip": lambda h, d: (h, 1),
    "k.center": lambda h, d: (), "v.center": lambda h, d: (),
    "k.center_gain": lambda h, d: (), "v.center_gain": lambda h, d: (),
    "kv.outlier_pool": lambda h, d: (), "kv.outlier_gain": lambda h, d: (),
}


# ====================================================================== registry and base class


def _context(cfg):
    """What the fitting pipeline hands a method: a fresh FitContext with the layer's codec
    factory (Huffman codebooks encode the reservoir with it)."""
    from kvcalib.codec import LayerCodec
    from kvcalib.methods.base import FitContext

    return FitContext({}, codec=lambda tensors: LayerCodec.from_tensors(cfg, tensors))


def test_registry_order_and_names():
    assert list(METHODS) == ["prerope", "rotate", "center", "reorder", "clip", "errbound", "levels", "scale8", "outliers", "schedule",
                             "huffman"]
    for name, cls in METHODS.items():
        assert issubclass(cls, Method) and cls.name == name
        assert cls.tensors and all(isinstance(spec.doc, str) and spec.doc for spec in cls.tensors)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("cfg", [CFG, CFG_TOKEN_K], ids=["k-channel", "k-token"])
def test_method_produces_declared_finite_tensors(name, cfg):
    stats = default_stats()
    # Huffman leaves sides uncoded where coding would not shrink them (Gaussian 2-bit codes): code all
    method = METHODS[name](**({"only_if_smaller": False} if name == "huffman" else {}))
    out = method.fit(stats, cfg, seed=0, context=_context(cfg))
    assert out, f"{name} produced nothing for a quantized layer"
    assert set(out) <= set(method.tensor_keys())
    for key, t in out.items():
        assert not t.is_floating_point() or torch.isfinite(t).all(), key
        if key in SHAPES:
            assert tuple(t.shape) == SHAPES[key](2, 16), key
    again = method.fit(stats, cfg, seed=0, context=_context(cfg))
    assert all(torch.equal(out[k], again[k]) for k in out), "same seed must give the same tensors"


@pytest.mark.parametrize("name", list(METHODS))
def test_method_refuses_stats_of_another_model(name):
    stats = default_stats(h=2, d=16)
    with pytest.raises(CalibrationError, match="another model"):
        METHODS[name]().fit(stats, CFG, heads=4, head_dim=16)
    with pytest.raises(CalibrationError, match="another model"):
        METHODS[name]().fit(stats, CFG, heads=2, head_dim=32)
    mixed = default_stats()
    mixed.v["max"] = torch.zeros(3, 16)  # a (H, D) field of another shape
    with pytest.raises(KvcalibError, match="mixes models"):
        METHODS[name]().fit(mixed, CFG)


@pytest.mark.parametrize("name", list(METHODS))
def test_method_refuses_nan_statistics(name):
    stats = default_stats()
    stats.k["mean"][0, 3] = float("nan")
    with pytest.raises(CalibrationError, match="NaN"):
        METHODS[name]().fit(stats, CFG)
    stats = default_stats()
    stats.reservoir_v[0, 0, 0, 0] = float("inf")
    if METHODS[name].needs_reservoir:
        with pytest.raises(CalibrationError, match="NaN or inf"):
            METHODS[name]().fit(stats, CFG)


@pytest.mark.parametrize("name", list(METHODS))
def test_method_empty_reservoir(name):
    stats = default_stats()
    stats.reservoir_k, stats.reservoir_v = stats.reservoir_k[:0], stats.reservoir_v[:0]
    stats.reservoir_q = stats.reservoir_q[:0]
    if METHODS[name].needs_reservoir:
        with pytest.raises(CalibrationError, match="empty"):
            METHODS[name]().fit(stats, CFG)
    else:  # moments-only steps still fit
        assert METHODS[name]().fit(stats, CFG)


@pytest.mark.parametrize("name", list(METHODS))
def test_method_constant_channels_never_nan(name):
    k = torch.full((2, 16, 2, 8), 0.5)
    k[..., :4] = -1.25  # constant channels, zero range everywhere
    stats = make_stats(k, k.clone())
    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=4, window=8)
    out = METHODS[name]().fit(stats, cfg, context=_context(cfg))
    for key, t in out.items():
        assert not t.is_floating_point() or torch.isfinite(t).all(), key
    if "v.clip" in out:
        assert torch.equal(out["v.clip"], torch.ones(2, 1)), "constant data: ties go to alpha = 1"
    if "v.perm" in out:
        check_perm(out["v.perm"], 2, 8)


@pytest.mark.parametrize("name", list(METHODS))
def test_method_skips_full_precision_layer(name):
    assert METHODS[name]().fit(default_stats(), LayerConfig()) == {}


def test_method_config_rejects_bad_values():
    for bad in (lambda: ReorderMethod(n_init=0), lambda: CenterMethod(mean_bits=4),
                lambda: CenterMethod(min_gain=1.5), lambda: OutlierMethod(pool=-1),
                lambda: METHODS["clip"](grid=()), lambda: METHODS["clip"](objective="l1"),
                lambda: METHODS["schedule"](ages=(4096, 1024))):
        with pytest.raises(ValueError):
            bad()


def test_layer_config_group_must_fit_head_dim():
    with pytest.raises(CalibrationError, match="head_dim"):
        METHODS["clip"]().fit(default_stats(d=16), LayerConfig(k_bits=2, v_bits=2, v_group=12, window=32))


def test_fit_layer_and_fit_stats_pipeline():
    stats = default_stats()
    layer = fit_layer(stats, CFG, seed=1)
    assert {"v.perm", "k.clip", "v.clip", "kv.schedule"} <= set(layer)
    info = ModelInfo(name="tiny", model_type="llama", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                     max_positions=512, sliding_window=(None, None), config_hash="0")
    collected = CollectedStats(model=info, layers=[stats, default_stats(seed=1)])
    tensors = fit_stats(collected, [CFG, LayerConfig()], methods=["reorder", "clip"])
    assert set(tensors) == {"layers.0.v.perm", "layers.0.k.clip", "layers.0.v.clip"}
    with pytest.raises(CalibrationError, match="2 layers"):
        fit_stats(collected, [CFG])
    other = ModelInfo(**{**info.to_dict(), "num_kv_heads": 4, "sliding_window": (None, None)})
    with pytest.raises(CalibrationError, match="layer 0: .*another model"):
        fit_stats(CollectedStats(model=other, layers=collected.layers), [CFG, CFG])
    with pytest.raises(CalibrationError, match="unknown calibration method"):
        build_methods(["reorder", "nope"])
    assert [m.name for m in build_methods(["clip", "center"])] == ["center", "clip"]


def test_clip_uses_permutation_and_centering_from_earlier_steps():
    stats = default_stats()
    perm = torch.stack([torch.randperm(16, generator=_gen(h)) for h in range(2)])
    plain = METHODS["clip"]().fit(stats, CFG)
    with_perm = METHODS["clip"]().fit(stats, CFG, fitted={"v.perm": perm})
    assert with_perm["v.clip"].shape == plain["v.clip"].shape
    centred = METHODS["clip"]().fit(stats, CFG, fitted={"k.center": torch.tensor(8.0)})
    assert torch.isfinite(centred["k.clip"]).all()


def test_import_is_light():
    code = ("import sys, kvcalib, kvcalib.calibrate; "
            "bad = [m for m in ('sklearn', 'scipy', 'triton', 'optuna') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ====================================================================== reorder (SKVQ)


def _planted_channels(h: int, d: int, sizes: list[int], n: int = 400, seed: int = 0, wide: bool = False):
    """Tokens (n, H, D) whose channels fall in clusters of very different scale; per head a
    random placement. Returns (x, cluster_of_channel (H, D))."""
    g = _gen(seed)
    scales = torch.tensor([0.05, 1.0, 20.0, 400.0, 3.0, 60.0] if wide else [1.0, 4.0, 16.0, 64.0])[: len(sizes)]
    labels = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])  # (D,)
    lab = torch.stack([labels[torch.randperm(d, generator=g)] for _ in range(h)])  # (H, D)
    x = torch.randn(n, h, d, generator=g) * scales[lab] + scales[lab] * 0.5  # (n, H, D)
    return x, lab


@pytest.mark.parametrize("h,d,group", [(1, 16, 4), (3, 32, 8), (2, 64, 16)], ids=["h1-d16", "h3-d32", "h2-d64"])
def test_reorder_groups_planted_clusters(h, d, group):
    x, lab = _planted_channels(h, d, [group] * (d // group), seed=h)
    perm = fit_channel_permutation(channel_features_from_tokens(x), group, seed=0)
    check_perm(perm, h, d)
    grouped = torch.gather(lab, 1, perm).view(h, d // group, group)  # (H, groups, G) cluster labels
    assert (grouped == grouped[..., :1]).all(), "each group must hold one planted cluster"


def test_reorder_unequal_clusters_are_balanced_and_help():
    """Clusters of 12/4/8/8 channels with scales 0.05..400: groups are still exactly 8; the
    per-channel relative error collapses (small channels no longer share a range with large
    ones) while the absolute error, dominated by the largest channels, does not grow."""
    x, lab = _planted_channels(2, 32, [12, 4, 8, 8], seed=3, wide=True)
    perm = fit_channel_permutation(channel_features_from_tokens(x), 8, seed=0)
    check_perm(perm, 2, 32)
    grouped = torch.gather(lab, 1, perm).view(2, 4, 8)
    assert (grouped[:, 2:] == grouped[:, 2:, :1]).all(), "the two large-scale clusters fill their own groups"

    def errors(v):  # v (1, H, n, D) -> (mean relative error per channel, total squared error)
        sq = (quantize_dequantize_values(v, 2, 8) - v) ** 2
        return float((sq.mean(2) / v.var(2)).mean()), float(sq.sum())

    v = x.transpose(0, 1)[None]  # (1, H, n, D)
    rel_id, abs_id = errors(v)
    rel_perm, abs_perm = errors(apply_perm(v, perm))
    assert rel_perm < 1e-3 * rel_id
    assert abs_perm <= 1.01 * abs_id


def test_reorder_from_layer_stats_matches_tokens():
    x, lab = _planted_channels(2, 16, [4, 4, 4, 4], n=128, seed=5)
    stats = make_stats(x.view(4, 32, 2, 16))
    perm = ReorderMethod().fit(stats, LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=4, window=8))["v.perm"]
    grouped = torch.gather(lab, 1, perm).view(2, 4, 4)
    assert (grouped == grouped[..., :1]).all()
    f = channel_features(stats, "v")
    assert f.shape == (2, 16, 5) and torch.isfinite(f).all() and f.abs().max() <= 1.0


def test_reorder_qk_invariance_exact_gqa():
    g = _gen(7)
    b, h, rep, t, d = 2, 3, 3, 5, 16
    q = torch.randint(-8, 9, (b, h * rep, t, d), generator=g).float()  # integers: sums are exact
    k = torch.randint(-8, 9, (b, h, t, d), generator=g).float()
    perm = torch.stack([torch.randperm(d, generator=g) for _ in range(h)])
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2)
    scores_p = apply_perm(q, perm) @ apply_perm(k, perm).repeat_interleave(rep, 1).transpose(-1, -2)
    assert torch.equal(scores, scores_p)
    # values: output un-permutation recovers the output exactly
    v = torch.randint(-8, 9, (b, h, t, d), generator=g).float()
    p = torch.randint(0, 4, (b, h * rep, t, t), generator=g).float()
    out = p @ v.repeat_interleave(rep, 1)
    out_p = p @ apply_perm(v, perm).repeat_interleave(rep, 1)
    assert torch.equal(apply_perm(out_p, invert_perm(perm)), out)


def test_apply_and_invert_perm():
    g = _gen(1)
    perm = torch.stack([torch.randperm(8, generator=g) for _ in range(2)])
    x = torch.randn(3, 2, 4, 8, generator=g)
    y = apply_perm(x, perm)
    assert torch.equal(y[:, 1, :, 5], x[:, 1, :, perm[1, 5]])
    assert torch.equal(apply_perm(y, invert_perm(perm)), x)
    xq = torch.randn(3, 6, 4, 8, generator=g)  # query heads, rep 3: head i uses perm[i // 3]
    assert torch.equal(apply_perm(xq, perm)[:, 4], xq[:, 4][..., perm[1]])
    xt = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # non-contiguous input
    assert torch.equal(apply_perm(xt, perm), y)
    with pytest.raises(CalibrationError):
        apply_perm(torch.randn(2, 5, 4, 8), perm)


def test_reorder_fallbacks_and_bad_input():
    same = torch.ones(2, 16, 5)  # all channels identical: KMeans cannot find 4 clusters
    assert torch.equal(fit_channel_permutation(same, 4), torch.arange(16).expand(2, 16))
    zero = torch.zeros(1, 16, 5)
    assert torch.equal(fit_channel_permutation(zero, 4), torch.arange(16)[None])
    f = torch.randn(2, 16, 5, generator=_gen(0))
    assert torch.equal(fit_channel_permutation(f, 16), torch.arange(16).expand(2, 16))  # one group
    assert torch.equal(fit_channel_permutation(f, 4, seed=3), fit_channel_permutation(f, 4, seed=3))
    two = torch.zeros(1, 16, 5)
    two[0, 8:, 1] = 1.0  # only 2 distinct rows for 4 clusters: range-sorted fallback
    p = fit_channel_permutation(two, 4)
    check_perm(p, 1, 16)
    assert torch.equal(p[0, :8].sort().values, torch.arange(8))
    for bad_group in (0, 5, 32):
        with pytest.raises(CalibrationError, match="group"):
            fit_channel_permutation(f, bad_group)
    nan = f.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(CalibrationError, match="NaN"):
        fit_channel_permutation(nan, 4)
    with pytest.raises(CalibrationError):
        fit_channel_permutation(torch.randn(16, 5), 4)
    with pytest.raises(CalibrationError, match="permutation"):
        check_perm(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(CalibrationError):
        channel_features_from_tokens(torch.zeros(0, 2, 4))


def test_reorder_only_where_groups_span_channels():
    stats = default_stats()
    out = ReorderMethod().fit(stats, CFG_TOKEN_K)
    assert set(out) == {"k.perm", "v.perm"}
    out = ReorderMethod().fit(stats, LayerConfig(k_bits=2, v_bits=16, k_group=8, window=8))
    assert out == {}, "per-channel keys: a permutation would change nothing"
    out = ReorderMethod().fit(stats, CFG, fitted={"v.center": torch.tensor(8.0)})  # centred features
    check_perm(out["v.perm"], 2, 16)


# ====================================================================== clip (SKVQ)


def _heavy_tailed(nb=3, bl=32, h=2, rep=2, d=16, seed=0):
    g = _gen(seed)
    base = torch.randn(nb, bl, h, d, generator=g)
    spikes = (torch.rand(nb, bl, h, d, generator=g) < 0.01) * torch.randn(nb, bl, h, d, generator=g) * 25
    k = base + spikes
    v = torch.randn(nb, bl, h, d, generator=g) + spikes.roll(1, dims=-1)
    q = torch.randn(nb, bl, h * rep, d, generator=g)
    return k, v, q


@pytest.mark.parametrize("side", ["k", "v"])
def test_clip_lowers_attention_output_error_on_heavy_tails(side):
    k, v, q = _heavy_tailed()
    errs = clip_errors(k, v, q, 0.25, 2, 8, side)  # (A, H)
    alpha = choose_alpha(errs, DEFAULT_GRID)
    assert alpha.shape == (2,) and (alpha < 1).all()
    chosen = errs[[DEFAULT_GRID.index(round(float(a), 2)) for a in alpha], torch.arange(2)]
    assert (chosen < 0.9 * errs[0]).all(), "the fitted alpha must beat no clipping by >10%"
    assert torch.equal(fit_clip_alpha(k, v, q, 0.25, 2, 8, side), alpha)


def test_clip_uniform_data():
    g = _gen(2)
    u = torch.rand(3, 64, 2, 32, generator=g) * 2 - 1  # groups of 32 samples: ranges ~ the full [-1, 1]
    q = torch.randn(3, 64, 4, 32, generator=g)
    for side in ("k", "v"):
        assert torch.equal(fit_clip_alpha(u, u, q, 0.25, 8, 32, side), torch.ones(2)), "8 bits: no clipping"
        a2 = fit_clip_alpha(u, u, q, 0.25, 2, 32, side)
        # min-max grids waste half a step at each end: the optimum for uniform data is ~3/4 at 2 bits
        assert ((a2 >= 0.7) & (a2 <= 0.9)).all(), a2
    two_level = torch.randint(0, 2, (3, 64, 2, 32), generator=g).float() * 2 - 1  # values on the extremes
    assert torch.equal(fit_clip_alpha(two_level, two_level, q, 0.25, 2, 32, "v"), torch.ones(2))


def test_clip_objectives_and_constant_data():
    k, v, q = _heavy_tailed(seed=1)
    mse = fit_clip_alpha(k, v, q, 0.25, 2, 8, "v", objective="mse")
    assert mse.shape == (2,) and ((mse > 0) & (mse <= 1)).all()
    const = torch.full((2, 16, 2, 8), 3.0)
    for side in ("k", "v"):
        errs = clip_errors(const, const, q[:2, :16, :, :8], 0.25, 2, 8, side)
        assert torch.isfinite(errs).all()
        assert torch.equal(choose_alpha(errs, DEFAULT_GRID), torch.ones(2))
    assert torch.equal(fit_clip_alpha(k, v, q, 0.25, 16, 8, "k"), torch.ones(2))


def test_clip_key_permutation_is_applied_to_queries():
    """Per-channel keys: a permutation changes nothing, if and only if q is permuted with k."""
    k, v, q = _heavy_tailed(seed=2)
    perm = torch.stack([torch.randperm(16, generator=_gen(h)) for h in range(2)])
    e0 = clip_errors(k, v, q, 0.25, 2, 8, "k")
    e1 = clip_errors(k, v, q, 0.25, 2, 8, "k", perm=perm)
    torch.testing.assert_close(e1, e0, rtol=1e-4, atol=1e-6)


def test_clip_chunking_does_not_change_errors(monkeypatch):
    import kvcalib.reservoir as reservoir_mod  # where the shared scoring chunks its blocks

    k, v, q = _heavy_tailed(nb=4, seed=3)
    e_all = clip_errors(k, v, q, 0.25, 4, 8, "k")
    monkeypatch.setattr(reservoir_mod, "_SCORE_BUDGET", 1)  # one block per chunk
    torch.testing.assert_close(clip_errors(k, v, q, 0.25, 4, 8, "k"), e_all, rtol=1e-9, atol=0)


def test_clip_bad_input():
    k, v, q = _heavy_tailed()
    with pytest.raises(CalibrationError, match="shorter than one key group"):
        clip_errors(k, v, q, 0.25, 2, 64, "k")
    with pytest.raises(CalibrationError, match="multiple of"):
        clip_errors(k, v, q[:, :, :3], 0.25, 2, 8, "v")
    with pytest.raises(CalibrationError, match="empty"):
        clip_errors(k[:0], v[:0], q[:0], 0.25, 2, 8, "v")
    bad = v.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(CalibrationError, match="NaN"):
        clip_errors(k, bad, q, 0.25, 2, 8, "v")
    for grid in ((), (1.2,), (0.0,), (float("nan"),)):
        with pytest.raises(CalibrationError, match="grid"):
            clip_errors(k, v, q, 0.25, 2, 8, "v", grid=grid)
    with pytest.raises(CalibrationError, match="scaling"):
        clip_errors(k, v, q, 0.0, 2, 8, "v")
    with pytest.raises(CalibrationError, match="side"):
        clip_errors(k, v, q, 0.25, 2, 8, "x")


# ====================================================================== center (TaDA)


def _shared_offset(nb=3, bl=32, h=4, d=16, seed=0, offset=8.0):
    """Tokens with a large per-token vector shared by all kv heads plus small per-head noise."""
    g = _gen(seed)
    shared = torch.randn(nb, bl, 1, d, generator=g) * offset
    return shared + torch.randn(nb, bl, h, d, generator=g) * 0.5


def test_center_round_trip_and_shapes():
    x = torch.randn(2, 3, 5, 8, generator=_gen(0))
    mean, dev = center(x)
    assert mean.shape == (2, 1, 5, 8) and dev.shape == (2, 3, 5, 8)
    torch.testing.assert_close(uncenter(mean, dev), x, rtol=0, atol=1e-6)
    torch.testing.assert_close(dev.mean(1), torch.zeros(2, 5, 8), rtol=0, atol=1e-6)
    for bits in (8, 16):
        m_hat, dev_hat = center(x, mean_bits=bits)  # deviations from the stored mean
        assert torch.equal(m_hat, quantize_mean(mean, bits))
        torch.testing.assert_close(uncenter(m_hat, dev_hat), x, rtol=0, atol=1e-6)
    with pytest.raises(CalibrationError):
        center(torch.randn(3, 5, 8))
    with pytest.raises(CalibrationError, match="mean_bits"):
        center(x, mean_bits=4)


@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("bits", [2, 4])
def test_center_planted_shared_offset_gain(side, bits):
    res = _shared_offset()
    gain = fit_centering_gain(res, bits, 8, side)
    assert gain > 0.9, gain
    plain, centred = centering_errors(res, bits, 8, side)
    assert centred < 0.1 * plain
    out = CenterMethod().fit(make_stats(res), LayerConfig(k_bits=bits, v_bits=bits, k_group=8, v_group=8, window=8))
    assert float(out[f"{side}.center"]) == 8.0


def test_center_single_head_is_noop():
    x = torch.randn(2, 1, 6, 8, generator=_gen(1))
    mean, dev = center(x)
    assert torch.equal(dev, torch.zeros_like(x)) and torch.equal(mean, x)
    res = _shared_offset(h=1)
    assert fit_centering_gain(res, 2, 8, "k") == 0.0
    out = CenterMethod().fit(make_stats(res, rep=4), LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8))
    assert float(out["k.center"]) == 0.0 and float(out["v.center"]) == 0.0


def test_center_independent_heads_stay_off():
    """Without shared structure the gain is only the 1/H of moved variance: centering stays off."""
    res = torch.randn(4, 32, 4, 16, generator=_gen(2))
    gain = fit_centering_gain(res, 2, 8, "v")
    assert abs(gain - 0.25) < 0.05
    out = CenterMethod().fit(make_stats(res), LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8))
    assert float(out["v.center"]) == 0.0 and abs(float(out["v.center_gain"]) - gain) < 1e-3  # fp16 reservoir


def test_center_mean_bytes_counted():
    assert mean_bytes_per_token(128, 16) == 256.0
    assert mean_bytes_per_token(128, 8) == 132.0  # 128 one-byte codes + fp16 scale + fp16 zero
    assert mean_bits_per_element(8, 128, 16) == 2.0  # 16 / H
    assert mean_bits_per_element(2, 64, 16) == 8.0
    mean = torch.randn(1, 1, 10, 64, generator=_gen(3))
    assert quantize_values(mean, 8, 64).nbytes() == 10 * mean_bytes_per_token(64, 8)
    assert torch.equal(quantize_mean(mean, 8), dequantize_values(quantize_values(mean, 8, 64)))
    assert torch.equal(quantize_mean(mean, 16), mean.half().float())


def test_center_constant_data_no_nan():
    const = torch.full((2, 16, 3, 8), 2.5)
    assert fit_centering_gain(const, 2, 8, "k") == 0.0
    assert fit_centering_gain(const, 2, 8, "v") == 0.0
    with pytest.raises(CalibrationError, match="empty"):
        fit_centering_gain(const[:0], 2, 8, "k")


# ====================================================================== outliers (OTT)


def _planted_outlier_keys(b=2, h=3, t=96, d=16, seed=0):
    """Keys with an outlier channel (+12) and per head 1 token per group of 32 with tiny keys."""
    g = _gen(seed)
    k = torch.randn(b, h, t, d, generator=g)
    k[..., 0] += 12.0
    planted = torch.zeros(b, h, t, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for s in range(0, t, 32):
                pos = s + int(torch.randint(0, 32, (1,), generator=g))
                planted[bi, hi, pos] = True
    k[planted] *= 0.02  # far below the others in the outlier channel and in norm
    return k, planted


def test_outliers_planted_tokens_are_caught_per_head():
    k, planted = _planted_outlier_keys()
    fp, state = trace_outliers(k, 32, pool_size=3)
    assert fp.shape == planted.shape
    assert (fp | ~planted).all(), "every planted token must be kept in full precision"
    assert (fp.sum(-1) >= 3).all()
    assert state.pool_pos.shape == (2, 3, 3) and state.extra_pos.shape == (2, 3, 32)
    assert not torch.equal(fp[0, 0], fp[0, 1]), "selection is per kv head"


def test_outliers_group_range_excludes_pool_tokens():
    k, planted = _planted_outlier_keys(b=1, h=2, t=32)
    v = torch.randn_like(k)
    sel = select_outliers(k, v, None, group_start=0, pool_size=3)
    assert not (sel.quant_mask & planted).any()
    q = sel.quant_mask  # (B, H, G)
    inf = torch.tensor(float("inf"))
    lo = torch.where(q[..., None], k, inf).amin(2)  # (B, H, D) range of the quantized tokens
    hi = torch.where(q[..., None], k, -inf).amax(2)
    assert torch.equal(sel.k_fill.amin(2), lo) and torch.equal(sel.k_fill.amax(2), hi)
    via_fill = quantize_keys(sel.k_fill, 2, 32)
    via_mask = quantize_keys(k, 2, 32, valid=q)
    assert torch.equal(via_fill.scale, via_mask.scale) and torch.equal(via_fill.zero, via_mask.zero)
    plain = quantize_keys(k, 2, 32)
    assert (via_mask.scale[..., 0] < 0.5 * plain.scale[..., 0]).all(), "the outlier channel's range shrinks"
    assert torch.equal(sel.k_fill[q], k[q]) and torch.equal(sel.v_fill[q], v[q])


def test_outliers_smallest_norm_rule_and_partition():
    g = _gen(4)
    b, h, gsz, d, p = 2, 3, 8, 4, 3
    state = None
    seen = []
    for step in range(4):
        k = torch.randn(b, h, gsz, d, generator=g) * torch.rand(b, h, gsz, 1, generator=g) * 3
        before = state
        sel = select_outliers(k, k, state, group_start=step * gsz, pool_size=p, extra_capacity=32)
        # brute force: the p smallest norms among the old pool and this group
        for bi in range(b):
            for hi in range(h):
                cands = [(float(k[bi, hi, j].norm()), step * gsz + j) for j in range(gsz)]
                if before is not None:
                    cands += [(float(before.pool_k[bi, hi, j].norm()), int(before.pool_pos[bi, hi, j]))
                              for j in range(p) if before.pool_pos[bi, hi, j] >= 0]
                want = sorted(pos for _, pos in sorted(cands)[:p])
                assert sorted(sel.state.pool_pos[bi, hi].tolist()) == want
        state = sel.state
        seen.append(sel.quant_mask)
    quantized = torch.cat(seen, dim=-1)  # (B, H, T)
    for bi in range(b):
        for hi in range(h):
            fp_pos = state.full_precision_positions()[bi][hi]
            q_pos = torch.nonzero(quantized[bi, hi]).flatten().tolist()
            assert sorted(fp_pos + q_pos) == list(range(4 * gsz)), "every token exactly once"
            pool_k = torch.cat([state.pool_k[bi, hi], state.extra_k[bi, hi]])
            pos = torch.cat([state.pool_pos[bi, hi], state.extra_pos[bi, hi]])
            assert int(pos.ge(0).sum()) == len(fp_pos) and pool_k.shape[-1] == d


def test_outliers_extra_pool_fills_then_tracking_stops():
    b, h, gsz, d, p, cap = 1, 1, 4, 4, 2, 4
    state = None
    stopped_at = None
    for step in range(5):
        k = torch.ones(b, h, gsz, d)
        k[:, :, :p] = 0.5 ** (step + 1)  # each flush brings p new, smaller tokens: p evictions
        sel = select_outliers(k, k, state, group_start=step * gsz, pool_size=p, extra_capacity=cap)
        state = sel.state
        if step < 3:
            assert int(sel.evicted.sum()) == (p if step else 0)
            assert not sel.quant_mask[..., :p].any()
        if stopped_at is None and not bool(state.tracking.all()):
            stopped_at = step
    # flushes 1 and 2 evict 2 each: the extra pool (4) is full after flush 2 and tracking stops
    assert stopped_at == 2
    assert int(state.extra_count) == cap
    assert state.extra_pos[0, 0].tolist() == [0, 1, 4, 5]
    assert state.pool_pos[0, 0].sort().values.tolist() == [8, 9]
    assert sel.quant_mask.all(), "after tracking stopped the whole group is quantized"


def test_outliers_overflowing_flush_is_quantized_whole():
    b, h, gsz, d = 1, 1, 4, 4
    state = OutlierState.empty(b, h, d, pool_size=2, extra_capacity=3)
    k = torch.ones(b, h, gsz, d)
    k[:, :, :2] = 0.5
    state = select_outliers(k, k, state, 0).state  # pool = {0, 1}
    k2 = k.clone()
    k2[:, :, 0] = 0.25
    state = select_outliers(k2, k2, state, 4).state  # evicts 1 -> extra 1/3
    k3 = k.clone()
    k3[:, :, :2] = 0.1
    sel = select_outliers(k3, k3, state, 8)  # would evict 2: fits (room 2) -> extra full, stop
    assert int(sel.evicted.sum()) == 2 and not bool(sel.state.tracking)
    state = OutlierState.empty(b, h, d, pool_size=2, extra_capacity=1)
    state = select_outliers(k, k, state, 0).state
    sel = select_outliers(k3, k3, state, 4)  # 2 evictions, room 1: stop, quantize whole, pools unchanged
    assert bool(sel.stopped) and sel.quant_mask.all()
    assert torch.equal(sel.state.pool_pos, state.pool_pos) and int(sel.state.extra_count) == 0


def test_outliers_pool_zero_and_bad_input():
    k = torch.randn(2, 3, 8, 4, generator=_gen(5))
    sel = select_outliers(k, k, None, 0, pool_size=0)
    assert sel.quant_mask.all() and torch.equal(sel.k_fill, k)
    fp, _ = trace_outliers(k, 4, pool_size=0)
    assert not fp.any()
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(CalibrationError, match="NaN"):
        select_outliers(bad, k, None, 0)
    with pytest.raises(CalibrationError):
        select_outliers(k, k[:, :2], None, 0)
    with pytest.raises(CalibrationError, match="does not fit"):
        select_outliers(k, k, OutlierState.empty(2, 4, 4), 0)
    fp, _ = trace_outliers(k, 3, pool_size=1)  # T=8: the incomplete last group is not flushed
    assert not fp[..., 6:].any()


def test_outliers_padding_never_enters_the_pool():
    k, _ = _planted_outlier_keys(b=2, h=2, t=64)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, :40] = False  # row 1: left padding over the first group and a half
    k[1, :, :40] *= 1e-3  # padding with the smallest norms of all
    fp, state = trace_outliers(k, 32, pool_size=3, valid=valid)
    assert not fp[1, :, :40].any() and fp[1, :, 40:].sum() == 2 * 3, "the pool fills from real tokens only"
    fp_all, _ = trace_outliers(k, 32, pool_size=3)
    assert torch.equal(fp[0], fp_all[0]), "rows are independent"
    assert state.pool_pos.dtype == torch.int32 and (state.pool_pos[1] >= 40).all()
    with pytest.raises(CalibrationError, match="valid"):
        select_outliers(k[:, :, :32], k[:, :, :32], None, 0, valid=valid[:, :31])


def test_outliers_default_pool_sizes_and_bytes():
    assert default_pool_sizes(5) == [0, 0, 3, 3, 3]
    assert default_pool_sizes(3, pool=1, skip_first=1) == [0, 1, 1]
    assert default_pool_sizes(1) == [0]
    with pytest.raises(CalibrationError):
        default_pool_sizes(-1)
    got = pool_bytes(heads=8, head_dim=128, pool_size=3, extra_capacity=32, tokens_flushed=4096)
    assert got == {"fp_k_v": 35 * 8 * 128 * 2 * 2.0, "positions": 35 * 8 * 4.0, "counters": 8 * 9.0,
                   "masks": 4096 * 8 / 8}
    assert sum(pool_bytes(8, 128, 0).values()) == 0


def test_outliers_fit_decides_pool_from_data():
    k, _ = _planted_outlier_keys(b=3, h=2, t=64, seed=1)
    res = k.transpose(1, 2).contiguous()  # (NB, BL, H, D)
    assert outlier_gain(res, 2, 32) > 0.2
    iid = torch.randn(3, 64, 2, 16, generator=_gen(6))
    assert abs(outlier_gain(iid, 2, 32)) < 0.05
    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=32, v_group=16, window=32)
    assert int(OutlierMethod().fit(make_stats(res), cfg)["kv.outlier_pool"]) == 3
    assert int(OutlierMethod().fit(make_stats(iid), cfg)["kv.outlier_pool"]) == 0
    assert int(OutlierMethod().fit(make_stats(res), CFG_TOKEN_K)["kv.outlier_pool"]) == 0


# ====================================================================== schedule (PATS tiers)


def test_schedule_validation():
    ok = Schedule((Tier(0, 16, 16), Tier(64, 8, 4), Tier(256, 4, 4), Tier(1024, 2, 2)), sinks=4)
    assert ok.window == 64
    bad = [
        ((Tier(8, 16, 16),), "age 0"),
        ((Tier(0, 16, 16), Tier(64, 8, 8), Tier(64, 4, 4)), "strictly increase"),
        ((Tier(0, 16, 16), Tier(64, 4, 4), Tier(128, 8, 4)), "may not increase"),
        ((Tier(0, 8, 8), Tier(64, 8, 8)), "repeats"),
        ((Tier(0, 16, 16), Tier(64, 16, 4), Tier(128, 8, 4)), "requantize"),
        ((), "at least one"),
    ]
    for tiers, msg in bad:
        with pytest.raises(ValueError, match=msg):
            Schedule(tiers)
    for args in ((0, 5, 4), (0, 4, 32), (-1, 4, 4), (0, True, 4)):
        with pytest.raises(ValueError):
            Tier(*args)
    assert Tier(0, 3, 2).k_bits == 3  # 3-bit tiers: a 3-bit layer (default space) halves to 2
    with pytest.raises(ValueError):
        Schedule((Tier(0, 4, 4),), sinks=-1)
    with pytest.raises(ValueError, match="unknown keys"):
        Schedule.from_dict({"tiers": [[0, 4, 4]], "window": 3})


def test_schedule_tiers_and_round_trips():
    s = Schedule(((0, 16, 16), {"age": 32, "k_bits": 8, "v_bits": 8}, Tier(100, 4, 2)), sinks=2)
    assert [s.tier_of(a) for a in (0, 31, 32, 99, 100, 10**6)] == [0, 0, 1, 1, 2, 2]
    assert s.bits_at(50) == (8, 8) and s.bits_at(100) == (4, 2)
    assert s.block_tier(block_end=200, context=232) == 1  # youngest token age 32
    assert s.block_tier(block_end=200, context=231) == 0
    assert s.bits_chain(2, "v") == [8, 2] and s.bits_chain(0, "k") == []
    assert Schedule.from_dict(s.to_dict()) == s
    assert Schedule.from_tensor(s.to_tensor(), sinks=2) == s
    assert s.to_tensor().dtype == torch.int64 and s.to_tensor().shape == (3, 3)
    with pytest.raises(CalibrationError):
        Schedule.from_tensor(torch.tensor([[0, 4, 4], [0, 2, 2]]))


def test_schedule_presets_mapping():
    mid = preset_schedule("middle-heavy", window=128, sinks=4)
    old = preset_schedule("old-heavy", window=128, sinks=4)
    new = preset_schedule("new-heavy", window=128, sinks=4)
    assert [(t.age, t.k_bits) for t in mid.tiers] == [(0, 16), (128, 8), (1024, 4), (4096, 2)]
    assert mid.sinks == 4 and old.sinks == 0 and old.tiers == mid.tiers  # both ends vs old end truncated
    assert new.window == 0 and new.sinks == 4 and new.tiers == (Tier(0, 2, 2),)  # recent end not protected
    assert set(PRESETS) == {"old-heavy", "middle-heavy", "new-heavy"}
    with pytest.raises(ValueError, match="unknown schedule preset"):
        preset_schedule("heavy")


@pytest.mark.parametrize("axis_kind", ["keys", "values"])
def test_requantize_exact_on_coarser_grid(axis_kind):
    """4-bit codes 0..15 with unit scale; values on multiples of 5 are exact at 2 bits."""
    g = _gen(8)
    x = torch.randint(0, 4, (2, 3, 8, 8), generator=g).float() * 5  # (B, H, T, D) in {0, 5, 10, 15}
    if axis_kind == "keys":  # every key group (8 tokens of a channel) spans [0, 15]
        x[..., 0, :], x[..., 1, :] = 0.0, 15.0
    else:  # every value group (8 channels of a token) spans [0, 15]
        x[..., 0], x[..., 1] = 0.0, 15.0
    fn, deq = (quantize_keys, dequantize_keys) if axis_kind == "keys" else (quantize_values, dequantize_values)
    qt4 = fn(x, 4, 8)
    assert torch.equal(qt4.scale, torch.ones_like(qt4.scale))
    qt2 = requantize(qt4, 2)
    assert qt2.bits == 2 and qt2.axis == qt4.axis and qt2.group == qt4.group
    assert qt2.scale.shape == qt4.scale.shape and qt2.codes.shape[-1] == 8 // 4
    assert torch.equal(deq(qt2), x)
    assert torch.equal(qt2.scale, torch.full_like(qt2.scale, 5.0))


@pytest.mark.parametrize("side", ["k", "v"])
def test_requantize_matches_chain_and_bounds(side):
    g = _gen(9)
    x = torch.randn(2, 2, 16, 32, generator=g) * 3
    fn = quantize_keys if side == "k" else quantize_values
    qt8 = fn(x, 8, 8)
    qt4 = requantize(qt8, 4)
    qt2 = requantize(qt4, 2)
    # the simulation's chain reproduces the packed requantizations bit for bit
    assert torch.equal(dequantize(qt2), fake_quantize_chain(x, side, [8, 4, 2], 8))
    assert torch.equal(dequantize(qt8), fake_quantize(x, side, 8, 8))
    # one requantization step costs at most half its new step on top of the 8-bit error
    y8, y4 = dequantize(qt8), dequantize(qt4)
    s4 = qt4.scale.float().unsqueeze(-2 if side == "k" else -1)
    diff = (y4 - y8).reshape(*y4.shape[:-2], -1, 8, 32) if side == "k" else (y4 - y8).reshape(*y4.shape[:-1], -1, 8)
    assert (diff.abs() <= s4 / 2 * (1 + 1e-3) + 1e-6).all()
    # SQNR: requantized 4 bits within 1.5 dB of quantizing the original directly at 4 bits
    def sqnr(y):
        return 10 * torch.log10((x**2).sum() / ((y - x) ** 2).sum())
    assert sqnr(y4) > sqnr(dequantize(fn(x, 4, 8))) - 1.5
    with pytest.raises(CalibrationError, match="fewer bits"):
        requantize(qt4, 4)
    with pytest.raises(CalibrationError, match="fewer bits"):
        requantize(qt4, 8)


def test_mantissa_truncate_bit_exact():
    vals = [1.0 + 2**-10, -(1.0 + 2**-10), 3.14159, -2.71828, 65504.0, 6e-8, 1e-5, 0.0, -0.0, 1.5, 0.333]
    x = torch.tensor(vals, dtype=torch.float16)
    for keep in range(11):
        got = mantissa_truncate(x, keep)
        ref = (x.numpy().view(np.uint16) & np.uint16((0xFFFF << (10 - keep)) & 0xFFFF)).view(np.float16)
        assert torch.equal(got.view(torch.int16), torch.from_numpy(ref.view(np.int16))), keep
    assert mantissa_truncate(x, 9)[0].item() == 1.0 and mantissa_truncate(x, 9)[1].item() == -1.0
    assert mantissa_truncate(torch.tensor([1.5], dtype=torch.float16), 0).item() == 1.0
    assert torch.equal(mantissa_truncate(x, 10), x)
    special = torch.tensor([float("inf"), -float("inf"), float("nan")], dtype=torch.float16)
    out = mantissa_truncate(special, 0)
    assert out[0] == float("inf") and out[1] == -float("inf") and torch.isnan(out[2])
    b = torch.tensor([1.0 + 2**-7, 3.0 + 2**-6, -5.75], dtype=torch.bfloat16)
    got = mantissa_truncate(b, 5)
    ref = b.view(torch.int16) & -(1 << 2)
    assert torch.equal(got.view(torch.int16), ref)
    assert got[0].item() == 1.0 and got[1].item() == 3.0
    assert truncated_width(torch.float16, 4) == 10 and truncated_width(torch.bfloat16, 7) == 16
    for args in ((x, 11), (b, 8), (x.float().long(), 2), (x, -1)):
        with pytest.raises(CalibrationError):
            mantissa_truncate(*args)
    nc = torch.randn(4, 6, dtype=torch.float16).t()  # non-contiguous
    assert torch.equal(mantissa_truncate(nc, 3), mantissa_truncate(nc.contiguous(), 3))


@pytest.mark.parametrize("k_axis", ["channel", "token"])
@pytest.mark.parametrize("context", [0, 5, 100, 161, 1000, 4096])
def test_schedule_bytes_single_tier_equals_layer_bytes(k_axis, context):
    cfg = LayerConfig(k_bits=4, v_bits=2, k_axis=k_axis, k_group=32, v_group=16, sinks=4, window=64)
    sched = Schedule.from_layer(cfg, ages=())
    assert sched.tiers == (Tier(0, 16, 16), Tier(64, 4, 2))
    got = schedule_bytes(sched, context, heads=3, head_dim=64, k_group=32, v_group=16, k_axis=k_axis)
    want = layer_bytes(cfg, 3, 64, context)
    assert got == want


def test_schedule_bytes_tiers():
    cfg = LayerConfig(k_bits=8, v_bits=8, k_group=32, v_group=32, sinks=4, window=128)
    sched = Schedule.from_layer(cfg, ages=(1024, 4096))
    assert [(t.age, t.k_bits) for t in sched.tiers] == [(0, 16), (128, 8), (1024, 4), (4096, 2)]
    sched.check_layer(cfg)
    where = tier_token_counts(sched, 4096)
    assert where == {"full_precision": 160, "tiers": [0, 896, 3040, 0]}  # 123 blocks of 32 flushed
    tiered = sum(schedule_bytes(sched, 4096, 8, 128).values())
    flat = sum(layer_bytes(cfg, 8, 128, 4096).values())
    codes = (896 * 8 + 3040 * 4) / 8 * 8 * 128 * 2  # K and V codes
    scales = (896 + 3040) // 32 * 8 * 128 * 2 * 2 * 2  # fp16 scale + zero per channel per block, K and V
    assert tiered == 160 * 8 * 128 * 2 * 2 + codes + scales
    assert tiered < flat
    with pytest.raises(CalibrationError, match="window"):
        sched.check_layer(LayerConfig(k_bits=8, v_bits=8, k_group=32, sinks=4, window=64))
    with pytest.raises(ValueError, match="beyond the window"):
        Schedule.from_layer(cfg, ages=(64,))


def test_schedule_method_output_fits_layer():
    out = METHODS["schedule"](ages=(256,)).fit(default_stats(), CFG)
    sched = Schedule.from_tensor(out["kv.schedule"], sinks=CFG.sinks)
    sched.check_layer(CFG)
    assert sched.tiers == (Tier(0, 16, 16), Tier(8, 2, 2))  # 2 bits cannot halve further
    cfg = LayerConfig(k_bits=8, v_bits=4, k_group=8, v_group=8, window=8)
    out = METHODS["schedule"](ages=(256,)).fit(default_stats(), cfg)
    assert out["kv.schedule"].tolist() == [[0, 16, 16], [8, 8, 4], [256, 4, 2]]


def test_validate_layer_stats_geometry():
    geom = validate_layer_stats(default_stats(h=2, d=16, nb=3, bl=32))
    assert (geom.heads, geom.head_dim, geom.q_heads, geom.blocks, geom.block_len, geom.rep) == (2, 16, 4, 3, 32, 2)
    stats = default_stats()
    stats.reservoir_q = stats.reservoir_q[:, :, :3]
    with pytest.raises(CalibrationError, match="multiple of 2"):
        validate_layer_stats(stats)
