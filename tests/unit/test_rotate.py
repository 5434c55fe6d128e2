"""The rotate method (kvcalib/methods/rotate.py): the rotation arithmetic, the fit and its decision,
the recipe tensors and their validation, the memory accounting, the export flag, inspect, the
search switch, and the decode-faithful simulation against a token-by-token decode."""

from __future__ import annotations

import pytest
import torch

from kvcalib.calibrate import fit_layer, fit_stats
from kvcalib.codec import LayerCodec
from kvcalib.errors import KvcalibError, RecipeError
from kvcalib.export import ExportConfig, export_recipe
from kvcalib.layout import LayerConfig
from kvcalib.methods.clip import ClipMethod, clip_errors
from kvcalib.methods.rotate import RotateMethod, rotate_reservoir, side_seed
from kvcalib.quant.rotation import hadamard, random_signs, rotate, unrotate
from kvcalib.quant.uniform import quantize_dequantize_keys, quantize_dequantize_values
from kvcalib.recipe import Recipe
from kvcalib.stats import CollectedStats
from tests.unit.parity import assert_decode_faithful
from tests.unit.test_calibrate import make_stats
from tests.unit.test_export import run_dir  # noqa: F401  (the shared statistics fixture)

CFG = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)
ALWAYS = RotateMethod(min_gain=-0.99)  # rotate every side whatever the gain (the tiny model's data)


def _outlier_stats(h: int = 2, d: int = 16, seed: int = 0):
    """Token blocks whose values carry one huge channel per head: per-token groups of channels
    waste their grid on it, a rotation spreads it over all channels."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(4, 32, h, d, generator=g)
    v = torch.randn(4, 32, h, d, generator=g)
    v[..., 3] *= 40.0
    return make_stats(k, v, seed=seed)


def test_hadamard_and_signs():
    for d in (1, 2, 16, 64):
        m = hadamard(d)
        assert torch.allclose(m @ m.T, torch.eye(d), atol=1e-6) and torch.equal(m, m.T)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(48)
    s = random_signs(3, 16, 7)
    assert torch.equal(s, random_signs(3, 16, 7)) and not torch.equal(s, random_signs(3, 16, 8))
    assert set(s.unique().tolist()) == {-1.0, 1.0}


def test_is_hadamard_names_the_shared_tensor_only():
    """The decode launcher's fast transform is for the shared Walsh-Hadamard tensor of a device
    (an identity test, no device sync); an equal copy, a fitted matrix or a wrong shape is a matrix
    like any other. The rotate method hands the kernels the shared tensor."""
    from kvcalib.methods.rotate import RotateState
    from kvcalib.quant.rotation import is_hadamard

    m = hadamard(16)
    assert is_hadamard(m) and is_hadamard(hadamard(16, "cpu")) and hadamard(16, "cpu") is m
    assert not is_hadamard(m.clone()) and not is_hadamard(torch.eye(16)) and not is_hadamard(m[None].expand(2, 16, 16))
    state = RotateState({"k": (m.clone(), random_signs(2, 16, 1)), "v": (hadamard(16), random_signs(2, 16, 2))})
    assert not is_hadamard(state.device_rotation("k", torch.device("cpu"))[0])  # a copy stays a copy
    assert is_hadamard(state.device_rotation("v", torch.device("cpu"))[0])
    assert state.device_rotation("v", torch.device("cpu")) is state.device_rotation("v", torch.device("cpu"))


@pytest.mark.parametrize("per_head", [False, True], ids=["hadamard", "per-head"])
def test_rotate_unrotate_and_gqa_heads(per_head):
    g = torch.Generator().manual_seed(0)
    h, d = 2, 16
    if per_head:
        m, _ = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
        m, s = m.float(), None
    else:
        m, s = hadamard(d), random_signs(h, d, 1)
    x = torch.randn(3, h, 5, d, generator=g)  # (B, H, N, D)
    y = rotate(x, m, s)
    assert float((unrotate(y, m, s) - x).abs().max()) < 1e-5
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4)  # orthogonal: norms kept
    q = torch.randn(3, 2 * h, 5, d, generator=g)  # query heads: head i reads kv head i // 2
    kv = torch.randn(3, h, 5, d, generator=g)
    scores = torch.einsum("bhtd,bhsd->bhts", rotate(q, m, s), rotate(kv, m, s).repeat_interleave(2, 1))
    assert torch.allclose(scores, torch.einsum("bhtd,bhsd->bhts", q, kv.repeat_interleave(2, 1)), atol=1e-4)


def test_codec_rotates_before_and_after_the_quantizer():
    m, s = hadamard(16), random_signs(2, 16, 3)
    x = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(1))  # (B, H, N, D)
    codec = LayerCodec(CFG, k_rotate=(m, s), v_rotate=(m, s))
    assert torch.equal(codec.roundtrip_keys(x), unrotate(quantize_dequantize_keys(rotate(x, m, s), 2, 8), m, s))
    assert torch.equal(codec.roundtrip_values(x), unrotate(quantize_dequantize_values(rotate(x, m, s), 2, 8), m, s))
    args = codec.kernel_attend("v", torch.device("cpu")).kernel_args("v")  # as the kernel launch takes them
    assert set(args) == {"v_rot"} and torch.equal(args["v_rot"][1], s)  # the kernel path takes it


def test_fit_rotates_where_the_error_falls():
    stats = _outlier_stats()
    cfg = LayerConfig(k_bits=4, v_bits=2, k_group=8, v_group=16, window=8)
    out = RotateMethod().fit(stats, cfg, seed=3)
    assert float(out["v.rotate_gain"]) > 0.1, "spreading one huge channel over 16 helps per-token groups"
    assert out["v.rotate"].tolist() == [side_seed(3, "v"), 2, 16]
    pca = RotateMethod(kind="pca").fit(stats, cfg, seed=3)
    assert pca["v.rotation"].shape == (2, 16, 16) and float(pca["v.rotate_gain"]) > 0.1
    strict = RotateMethod(min_gain=0.99).fit(stats, cfg, seed=3)
    assert "v.rotate" not in strict and "v.rotate_gain" in strict  # measured, left off
    assert RotateMethod().fit(stats, LayerConfig()) == {}  # nothing quantized
    with pytest.raises(ValueError, match="kind"):
        RotateMethod(kind="givens")


def test_learned_rotation_beats_the_hadamard_it_starts_from():
    """kind="learned": on a reservoir with one huge value channel per head, the rotation optimised
    from the Hadamard one lowers the reservoir error well below it (at 2 bits), is stored as one
    orthogonal (D, D) matrix every kv head shares (the recipe validation accepts it), and decodes
    through the kernel's general matrix path (kernel_attend hands it over without signs; the
    kernels read a (D, D) matrix with a head stride of 0). The per-head fit gives (H, D, D)."""
    from kvcalib.methods.rotate import fit_learned_rotation, rotation_errors

    stats = _outlier_stats()
    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=16, window=8)
    had = RotateMethod().fit(stats, cfg, seed=3)
    learned = RotateMethod(kind="learned").fit(stats, cfg, seed=3)
    assert float(learned["v.rotate_gain"]) > float(had["v.rotate_gain"]) + 0.2
    m = learned["v.rotation"]  # (D, D): shared by the heads
    assert m.shape == (16, 16) and "v.rotate" not in learned
    state = RotateMethod.load(learned, cfg, 2, 16)  # orthogonality is checked on load
    assert state.rot["v"][1] is None and torch.equal(state.rot["v"][0], m)
    # the fit starts at diag(signs) H: zero steps give back the Hadamard rotation itself
    signs = random_signs(2, 16, side_seed(3, "v"))
    start = fit_learned_rotation(stats, "v", 2, 16, "channel", signs, steps=0)
    torch.testing.assert_close(start, signs[:, :, None] * hadamard(16), rtol=0, atol=1e-6)
    _, err_start = rotation_errors(stats, "v", 2, 16, "channel", start, None)
    _, err_had = rotation_errors(stats, "v", 2, 16, "channel", hadamard(16), signs)
    assert err_start == pytest.approx(err_had, rel=1e-5)
    shared_start = fit_learned_rotation(stats, "v", 2, 16, "channel", signs, steps=0, shared=True)  # (D, D)
    torch.testing.assert_close(shared_start, signs[0][:, None] * hadamard(16), rtol=0, atol=1e-6)
    per_head = RotateMethod(kind="learned-head").fit(stats, cfg, seed=3)  # one matrix per kv head
    assert per_head["v.rotation"].shape == (2, 16, 16)
    assert float(per_head["v.rotate_gain"]) > float(had["v.rotate_gain"]) + 0.2
    assert RotateMethod.load(per_head, cfg, 2, 16).rot["v"][0].shape == (2, 16, 16)


def test_learned_rotation_falls_back_to_the_seed_where_it_does_not_win(monkeypatch):
    """A learned matrix that does not beat the Hadamard rotation is not stored: the side gets the
    seed (24 bytes, not H x D x D floats)."""
    from kvcalib.methods import rotate as rot_mod

    stats = _outlier_stats()
    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=16, window=8)
    monkeypatch.setattr(rot_mod, "fit_learned_rotation", lambda *a, **k: torch.eye(16))
    out = RotateMethod(kind="learned").fit(stats, cfg, seed=3)
    assert out["v.rotate"].tolist() == [side_seed(3, "v"), 2, 16] and "v.rotation" not in out


def test_later_methods_fit_on_the_rotated_reservoir():
    stats = _outlier_stats()
    cfg = LayerConfig(k_bits=16, v_bits=2, v_group=16, window=8)
    fitted = fit_layer(stats, cfg, [ALWAYS, ClipMethod()], seed=0)
    m, s = hadamard(16), random_signs(2, 16, side_seed(0, "v"))
    errs = clip_errors(stats.reservoir_k, rotate_reservoir(stats.reservoir_v, m, s), stats.reservoir_q,
                       stats.scaling, 2, 16, "v")
    from kvcalib.methods.clip import choose_alpha, DEFAULT_GRID

    assert torch.equal(fitted["v.clip"][:, 0], choose_alpha(errs, DEFAULT_GRID))


def test_recipe_tensors_are_validated():
    good = {"v.rotate": torch.tensor([5, 2, 16])}
    assert RotateMethod.load(good, CFG, 2, 16) is not None
    bad = [
        ({"v.rotate": torch.tensor([5, 3, 16])}, "for 3 kv heads"),
        ({"v.rotate": torch.tensor(5)}, r"int64 \(3,\)"),
        ({"v.rotate": torch.tensor([5, 2, 12])}, "12"),
        ({"k.rotation": torch.randn(2, 16, 16)}, "not orthogonal"),
        ({"k.rotation": torch.randn(16, 16)}, "not orthogonal"),
        ({"k.rotation": torch.eye(16)[None]}, "1 heads, expected 2"),
        ({"k.rotation": torch.eye(16).expand(2, 16, 16), "k.rotate": torch.tensor([1, 2, 16])}, "both"),
    ]
    for tensors, match in bad:
        with pytest.raises(ValueError, match=match):
            RotateMethod.load(tensors, CFG, 2, 16 if "12" not in match else None)


@pytest.fixture(scope="module")
def tiny(run_dir):
    out, model = run_dir
    return out, model, CollectedStats.load(out)


def test_rotation_is_accounted(tiny):
    _, _, stats = tiny
    info = stats.model
    h, d, n = info.num_kv_heads, info.head_dim, info.num_layers
    configs = [CFG] * n
    plain = Recipe(name="plain", layers=configs, model=info)
    rot = Recipe(name="rot", layers=configs, model=info, tensors=fit_stats(stats, configs, [ALWAYS]))
    assert sum(k.endswith(".rotate") for k in rot.tensors) == 2 * n
    mem, base = rot.memory(info, 256), plain.memory(info, 256)
    assert mem.components["rotate_tables"] == 2 * n * h * d * 4  # the signs each layer keeps on the device
    assert mem.components[f"rotate_hadamard_d{d}"] == d * d * 4  # one Walsh-Hadamard for the model
    recipe_bytes = sum(t.numel() * t.element_size() for t in rot.tensors.values())
    assert mem.total_bytes == base.total_bytes + 2 * n * h * d * 4 + d * d * 4 + recipe_bytes
    assert "rotate_tables" not in rot.memory(info, 4).components  # nothing packed yet


@pytest.mark.parametrize("kind", ["hadamard", "pca", "learned"])
def test_simulation_matches_token_by_token_decode(tiny, kind):
    _, model, stats = tiny
    assert_decode_faithful(model, stats, [RotateMethod(kind=kind, min_gain=-0.99)], CFG, "rotate")


def test_each_rotation_is_counted_once(tiny):
    """bytes = what the recipe stores + what the runtime holds beyond it, each once: a stored
    float32 matrix (pca, learned) is recipe state only -- the device rotates by that very tensor --
    a seed adds the signs it draws; one Walsh-Hadamard per head_dim for the model."""
    _, _, stats = tiny
    info = stats.model
    h, d, n = info.num_kv_heads, info.head_dim, info.num_layers
    fitted = torch.linalg.qr(torch.randn(h, d, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0]
    tensors = {"layers.0.k.rotation": fitted.float(), "layers.0.v.rotate": torch.tensor([2, h, d]),
               "layers.1.v.rotation": fitted[0].float()}  # a learned (D, D) every head shares
    configs = [CFG] * n
    rec = Recipe(name="mixed", layers=configs, model=info, tensors=tensors)
    base = Recipe(name="plain", layers=configs, model=info).memory(info, 256)
    mem = rec.memory(info, 256)
    stored = h * d * d * 4 + 24 + d * d * 4  # a stored (D, D) is not taken for the shared Walsh-Hadamard
    assert mem.components["recipe_state"] == stored
    assert mem.components["rotate_tables"] == h * d * 4  # the seed's signs only
    assert mem.components[f"rotate_hadamard_d{d}"] == d * d * 4
    assert mem.total_bytes == base.total_bytes + stored + h * d * 4 + d * d * 4
    only_learned = Recipe(name="learned", layers=configs, model=info, tensors={"layers.1.v.rotation": fitted[0].float()})
    assert f"rotate_hadamard_d{d}" not in only_learned.memory(info, 256).components  # no Walsh-Hadamard to hold
    from kvcalib.inspect import inspect_recipe

    report = inspect_recipe(rec, info, 256)
    assert report["memory"]["components"] == mem.components  # kvcalib inspect's bytes
    rows = report["layers"]  # the label by the stored shape: (H, D, D) per head, (D, D) shared (learned)
    assert (rows[0]["k_rotate"], rows[0]["v_rotate"], rows[1]["v_rotate"]) == ("pca", "hadamard", "learned")


def test_export_flag_inspect_and_search_switch(tiny, tmp_path):
    from kvcalib.inspect import inspect_recipe, method_lines
    from kvcalib.optimize.objective import SearchObjective
    from kvcalib.optimize.space import Point, SearchSpace, layer_switches

    out, model, stats = tiny
    rec = export_recipe(out, tmp_path / "r.safetensors", ExportConfig(bits="k2v2", group=8, window=8,
                                                                      rotate="hadamard"))
    assert rec.name == "k2v2-g8-rot-hadamard" and rec.provenance["methods"] == ["rotate"]
    assert all(f"layers.{i}.k.rotate_gain" in rec.tensors for i in range(stats.model.num_layers))
    with pytest.raises(KvcalibError, match="--rotate 'givens'"):
        ExportConfig(bits="k2v2", rotate="givens")
    report = inspect_recipe(str(tmp_path / "r.safetensors"))
    assert report["rotate"]["layers"] == stats.model.num_layers
    assert all("k_rotate_gain" in row for row in report["layers"])
    assert any(line.startswith("rotation on K") for line in method_lines(report))

    assert "rotate" in layer_switches()
    SearchSpace(layer_methods=("rotate", "clip"))  # a valid per-layer switch
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    obj = SearchObjective(model, stats.model, stats, ids, context=256)
    point = Point(8, 8, 0, (2, 2), (2, 2), (("rotate",), ()))
    fitted = obj.fitted_tensors(point)
    assert "layers.0.v.rotate_gain" in fitted and not any(k.startswith("layers.1.") for k in fitted)


def test_bad_recipe_names_the_tensor(tiny):
    _, _, stats = tiny
    info = stats.model
    rec = Recipe(name="bad", layers=[CFG] * info.num_layers, model=info,
                 tensors={"layers.1.k.rotate": torch.tensor([0, info.num_kv_heads + 1, info.head_dim])})
    with pytest.raises(RecipeError, match=r"layers\.1\.k\.rotate"):
        rec.codecs(info)
