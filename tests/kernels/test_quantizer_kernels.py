"""Issue 34's quantizers on the kernel paths, against their references: rotated K/V
(kvcalib.methods.rotate), and the fixed grids of the error-bounded quantizer
(kvcalib.methods.errbound), which the decode kernel reads as any packed side.

- decode attention with ``k_rot`` / ``v_rot``: the packed keys scored with the query rotated once
  per call, the packed values' accumulators rotated back once per call, the full-precision
  segments unrotated; vs :func:`kvcalib_kernels.reference.decode_attention_reference` (which
  rotates every stored token back), with the tolerance rule of ``test_decode_attention.py``;
  on both paths of the value side's back-rotation (its own launch, or inside the combine: the
  launcher's ``COMBINE_ROTATION_MIN_ROWS`` forced either way), with the rotation kernels and the
  rotating combine checked against the PyTorch products on their own;
- the runtime adapter (:mod:`kvcalib.runtime.triton_path`) over a rotated layer vs the runtime's
  reference attention on the same stored bytes;
- the quantize-and-pack path: a rotated layer's flushes through the kernels store exactly the
  reference codec's bytes.

On CPU through Triton's interpreter (small shapes), on CUDA as is.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, (da, qp) = kernel_modules("kvcalib_kernels.decode_attention", "kvcalib_kernels.quant_pack")
from kvcalib.codec import LayerCodec  # noqa: E402
from kvcalib.layout import LayerConfig  # noqa: E402
from kvcalib.quant.rotation import hadamard, random_signs  # noqa: E402
from tests.kernels.test_decode_attention import SMALL, _filled_layer, _kernel_path, _reference_path, check, make_case, \
    with_perm_mean  # noqa: E402


def _orthogonal(h: int, d: int, seed: int) -> torch.Tensor:
    """Random per-head orthogonal matrices (H, D, D) float32 (QR of a Gaussian)."""
    g = torch.Generator().manual_seed(seed)
    qmat, r = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
    return (qmat * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]).float()


def _rotation(kind: str, h: int, d: int, seed: int):
    """``(matrix, signs)`` on the device: the shared Walsh-Hadamard with per-head signs, fitted
    per-head matrices (pca), or one fitted matrix every head shares (shared: a learned rotation)."""
    if kind == "hadamard":  # the shared per-device tensor, as the rotate method passes it (is_hadamard)
        return hadamard(d, DEVICE), random_signs(h, d, seed).to(DEVICE)
    if kind == "shared":  # (D, D) without signs: the kernels read it with a head stride of 0
        return _orthogonal(1, d, seed)[0].to(DEVICE), None
    return _orthogonal(h, d, seed).to(DEVICE), None


@pytest.mark.parametrize("kind", ["hadamard", "pca", "shared"])
@pytest.mark.parametrize("h,rep,d,splits", [(2, 4, 32, 3), (1, 7, 64, 20), (3, 1, 16, 1)])
def test_rotation_kernels_match_the_torch_products(kind, h, rep, d, splits):
    """The launcher's two rotation kernels against :mod:`kvcalib.quant.rotation`'s products: the
    query rotated (any float dtype in, float32 out) and the accumulators of a call's packed
    columns rotated back in place, the other columns untouched."""
    from kvcalib.quant.rotation import rotate, unrotate
    from kvcalib_kernels.decode.rotation import rotate_back_partials, rotate_query

    torch.manual_seed(h * 100 + d)
    bsz, s_all, s_off = 2, splits + 5, 2
    rot = _rotation(kind, h, d, seed=d)
    q = torch.randn(bsz, h * rep, d, device=DEVICE).to(torch.bfloat16)  # (B, Hq, D)
    want = rotate(q.reshape(bsz, h, rep, d), *rot).reshape(bsz, h * rep, d)  # (B, Hq, D) float32
    got = rotate_query(q, h, rot)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-5, rtol=1e-5)

    o_part = torch.randn(bsz * h * rep, s_all, d, device=DEVICE)  # (B*Hq, S, D) float32
    before = o_part.clone()
    rotate_back_partials(o_part, bsz, h, s_off, splits, rot)
    cols = before.view(bsz, h, rep, s_all, d)[:, :, :, s_off:s_off + splits]  # (B, H, R, S', D)
    back = unrotate(cols.reshape(bsz, h, rep * splits, d), *rot).view(bsz, h, rep, splits, d)
    after = o_part.view(bsz, h, rep, s_all, d)
    assert torch.allclose(after[:, :, :, s_off:s_off + splits], back, atol=1e-5, rtol=1e-5)
    assert torch.equal(after[:, :, :, :s_off], before.view(bsz, h, rep, s_all, d)[:, :, :, :s_off])
    assert torch.equal(after[:, :, :, s_off + splits:], before.view(bsz, h, rep, s_all, d)[:, :, :, s_off + splits:])


@pytest.mark.parametrize("kind,rep,d,channels", [("hadamard", 3, 32, None), ("pca", 4, 64, 16), ("pca", 1, 16, None)])
def test_rotated_combine_matches_rotating_first(kind, rep, d, channels):
    """The combine that rotates a column range back inside the merge against rotating those
    columns first (:func:`kvcalib.quant.rotation.unrotate`) and merging in float64: outputs and
    log-sum-exp, rows nothing reached included, several output-channel programs (``channels``)."""
    from kvcalib.quant.rotation import unrotate
    from kvcalib_kernels.decode.combine import _combine_rotated

    torch.manual_seed(rep * 100 + d)
    bsz, h, s_all, lo, hi = 2, 2, 21, 3, 19  # partial columns [3, 19) rotated, 3 before and 2 after
    hq = h * rep
    rot = _rotation(kind, h, d, seed=d)
    m = torch.randn(bsz * hq, s_all, device=DEVICE) * 4  # (B*Hq, S) log2 units
    m[0] = -1.0e30  # a row that saw nothing
    l = torch.rand(bsz * hq, s_all, device=DEVICE) + 0.1  # (B*Hq, S)
    l[0] = 0.0
    o = torch.randn(bsz * hq, s_all, d, device=DEVICE)  # (B*Hq, S, D)
    o[0] = 0.0
    out = torch.empty(bsz, hq, d, device=DEVICE)  # (B, Hq, D)
    lse = torch.empty(bsz, hq, device=DEVICE)  # (B, Hq)
    _combine_rotated(m, l, o, s_all, out, lse, h, lo, hi, rot, channels=channels)

    o64 = o.double().view(bsz, h, rep, s_all, d).clone()  # (B, H, R, S, D)
    rotated = o64[:, :, :, lo:hi].reshape(bsz, h, rep * (hi - lo), d)
    o64[:, :, :, lo:hi] = unrotate(rotated, rot[0].double(), None if rot[1] is None else rot[1].double()).view(
        bsz, h, rep, hi - lo, d)
    m64 = m.double()
    w = torch.exp2(m64 - m64.max(1, keepdim=True).values)  # (B*Hq, S)
    den = (w * l.double()).sum(1)  # (B*Hq,)
    want = (w[:, :, None] * o64.view(bsz * hq, s_all, d)).sum(1) / den.clamp_min(1e-300)[:, None]
    assert torch.allclose(out.view(bsz * hq, d).double(), want, atol=1e-5, rtol=1e-5)
    want_lse = torch.where(den > 0, (m64.max(1).values + torch.log2(den.clamp_min(1e-300))) * 0.6931471805599453,
                           float("-inf"))
    assert torch.equal(lse.view(-1)[0].cpu(), torch.tensor(float("-inf")))
    assert torch.allclose(lse.view(-1)[1:].double(), want_lse[1:], atol=1e-5, rtol=1e-5)


def _spy_rotation_launches(monkeypatch) -> dict[str, int]:
    """Count the launcher's rotation launches (rotate_query, rotate_back_partials) and combines
    (the plain one, the one that rotates back)."""
    from kvcalib_kernels.decode import plan

    counts = {"rotate_query": 0, "rotate_back_partials": 0, "_combine": 0, "_combine_rotated": 0}
    for name in counts:
        real = getattr(plan, name)

        def spy(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(plan, name, spy)
    return counts


# COMBINE_ROTATION_MIN_ROWS forcing each path of the value side's back-rotation at any shape
ROTATION_PATHS = {"2launch": 1 << 62, "combine": 0}


def test_back_rotation_runs_in_the_combine_from_32_rows():
    """The shape rule on planned calls (no kernels): batch x kv heads rows below
    COMBINE_ROTATION_MIN_ROWS (batch 1 of 8 kv heads) rotate back by their own launch, from it
    on (batch 4 and 8) inside the combine, over the splits of the calls sharing the rotation."""
    from kvcalib_kernels.decode import plan

    assert plan.COMBINE_ROTATION_MIN_ROWS == 32
    rot = _rotation("hadamard", 8, 16, seed=0)  # matrix (D, D), signs (H, D) float32
    other = tuple(None if t is None else t.clone() for t in rot)  # equal values, other tensors
    for rows, in_combine in ((8, False), (31, False), (32, True), (64, True)):
        calls = [plan._SplitCall(rows, 9, (), {}, splits=6, v_rot=rot), plan._SplitCall(rows, 4, (), {}, splits=4),
                 plan._SplitCall(rows, 5, (), {}, splits=5, v_rot=rot),
                 plan._SplitCall(rows, 3, (), {}, splits=3, v_rot=other)]
        ordered, rot_cols = plan._combine_rotated_calls(calls)
        if in_combine:  # the rotation's whole-split call first, then the one with chunks
            assert rot_cols == 11 and [id(c) for c in ordered] == [id(calls[i]) for i in (2, 0, 1, 3)]
        else:
            assert rot_cols == 0 and [id(c) for c in ordered] == [id(c) for c in calls]


@pytest.mark.parametrize("path", list(ROTATION_PATHS))
@pytest.mark.parametrize("case", [
    dict(k="hadamard", v=None), dict(k=None, v="hadamard"), dict(k="hadamard", v="pca"),
    dict(k="pca", v="hadamard", dtype=torch.float32), dict(k="hadamard", v="hadamard", dtype=torch.float32),
], ids=["k-had", "v-had", "k-had-v-pca", "k-pca-v-had-fp32", "kv-had-fp32"])
def test_rotation_paths_pass_the_tolerance_rule(monkeypatch, path, case):
    """Both back-rotation paths on K rotated only, V only, both; Walsh-Hadamard and fitted
    matrices; bfloat16 and float32 queries; sinks and a window beside the packed tokens (plain and
    rotated partials meet in the combine) and a ragged batch (packed ranges). Each path takes the
    launches it says it takes: the query its own launch for a fitted matrix (a Walsh-Hadamard one
    rotates inside the split kernel), the accumulators their own launch and the plain combine, or
    the rotating combine alone."""
    from kvcalib_kernels.decode import plan

    case = dict(case)
    k_kind, v_kind = case.pop("k"), case.pop("v")
    monkeypatch.setattr(plan, "COMBINE_ROTATION_MIN_ROWS", ROTATION_PATHS[path])
    args, kw = make_case(b=2, rep=3, n=48, **case)
    h, d = args[1].shape[1], args[0].shape[-1]
    rot = {}
    if k_kind:
        rot["k_rot"] = _rotation(k_kind, h, d, seed=1)
    if v_kind:
        rot["v_rot"] = _rotation(v_kind, h, d, seed=2)
    ranged = {"packed_start": torch.tensor([0, 7], device=DEVICE), "packed_end": torch.tensor([48, 30], device=DEVICE)}
    check(args, {**kw, **rot, **ranged})
    # the launches of one more call: the first call on a GPU also probes the fast unpack paths
    # once per process (plan.fast_unpack_available), with combines of their own
    counts = _spy_rotation_launches(monkeypatch)
    da.decode_attention(*args, **kw, **rot, **ranged, config=SMALL)
    in_combine = v_kind is not None and path == "combine"
    assert counts == {"rotate_query": int(k_kind == "pca"),
                      "rotate_back_partials": int(v_kind is not None and not in_combine),
                      "_combine": int(not in_combine), "_combine_rotated": int(in_combine)}


@pytest.mark.parametrize("case", [
    dict(rep=3, n=48, dtype=torch.bfloat16), dict(rep=3, n=48, dtype=torch.float32),
    dict(rep=1, n=64, d=128, k_bits=4, v_bits=4, dtype=torch.float16), dict(rep=7, n=48, k_bits=8, v_bits=2),
    dict(rep=3, n=48, k_axis="token", k_group=16, dtype=torch.float32),
], ids=["bf16", "fp32", "d128-gqa1-4b", "gqa7-k8v2", "token-keys-fp32"])
def test_hadamard_query_rotated_in_the_split_kernel_equals_its_launch(monkeypatch, case):
    """A Walsh-Hadamard key rotation: the split kernel's own fast transform of the query (ROT_Q,
    no launch) against the launch of the matrix product before it, which a copy of the matrix (not
    the shared tensor) takes, on a ragged batch with sinks and a window; both float32 products of
    one rotation, so they agree to a rounding step of the 16-bit query planes (a wrong rotation is
    off by the output's own scale), inside the tolerance rule (checked too)."""
    args, kw = make_case(b=2, **case)
    h, d = args[1].shape[1], args[0].shape[-1]
    n = args[1].shape[2]
    rot = {"k_rot": _rotation("hadamard", h, d, seed=5), "v_rot": _rotation("hadamard", h, d, seed=6)}
    ranged = {"packed_start": torch.tensor([0, 16], device=DEVICE), "packed_end": torch.tensor([n, n - 16], device=DEVICE)}
    counts = _spy_rotation_launches(monkeypatch)
    fused = check(args, {**kw, **rot, **ranged})
    assert counts["rotate_query"] == 0
    copied = {"k_rot": (rot["k_rot"][0].clone(), rot["k_rot"][1]), "v_rot": rot["v_rot"]}
    launched = da.decode_attention(*args, **kw, **copied, **ranged, config=SMALL)
    assert counts["rotate_query"] == 1
    scale = float(launched.abs().max())
    assert float((fused - launched).abs().max()) <= 2e-3 * scale  # a 16-bit rounding of a query plane, at most


@pytest.mark.parametrize("case", [
    dict(path="combine", copies=False, launches=0), dict(path="combine", copies=True, launches=1),
    dict(path="2launch", copies=False, launches=2),
], ids=["one-rotation", "two-rotation-objects", "separate-launches"])
def test_rotated_parts_rotate_back_in_the_combine(monkeypatch, case):
    """Two packed parts (the first with the window's chunks after its splits): one rotation shared
    by the parts rotates back inside the combine over both parts' splits (the part without chunks
    placed first, so the splits are one column range); a second rotation (other tensors) keeps
    its own launch; on the two-launch path each part takes one."""
    from kvcalib_kernels.decode import plan

    monkeypatch.setattr(plan, "COMBINE_ROTATION_MIN_ROWS", ROTATION_PATHS[case["path"]])
    args, kw = make_case(n=64, dtype=torch.bfloat16)
    h, d = args[1].shape[1], args[0].shape[-1]
    rot = {"k_rot": _rotation("hadamard", h, d, 3), "v_rot": _rotation("pca", h, d, 4)}
    second_rot = {k: tuple(None if t is None else t.clone() for t in r) for k, r in rot.items()} if case["copies"] else rot
    q, kc, ks, kz, vc, vs, vz = args
    half = 32  # two whole key groups of 16
    packed = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
    common = {k: v for k, v in kw.items() if k not in ("fp_segments", "fp_positions", "packed_position")}
    first = dict(zip(packed, (kc[:, :, :half], ks[:, :, :half // 16], kz[:, :, :half // 16], vc[:, :, :half],
                              vs[:, :, :half], vz[:, :, :half])), **common, **rot,
                 packed_position=kw["packed_position"], fp_segments=kw["fp_segments"], fp_positions=kw["fp_positions"])
    second = dict(zip(packed, (kc[:, :, half:], ks[:, :, half // 16:], kz[:, :, half // 16:], vc[:, :, half:],
                               vs[:, :, half:], vz[:, :, half:])), **common, **second_rot,
                  packed_position=kw["packed_position"] + half)
    # the whole cache first: a process's first call on a GPU also probes the fast unpack paths
    # (plan.fast_unpack_available), with combines of its own that the spy would count
    whole = da.decode_attention(*args, **kw, **rot, config=SMALL)
    counts = _spy_rotation_launches(monkeypatch)
    out = da.decode_attention_parts(q, [first, second], config=SMALL)
    # Walsh-Hadamard keys rotate the query in the split kernel; the second part's copied matrix
    # is not the shared tensor, so it takes the query's launch
    assert counts["rotate_query"] == int(case["copies"]) and counts["rotate_back_partials"] == case["launches"]
    assert counts["_combine_rotated"] == int(case["path"] == "combine") and counts["_combine"] == int(
        case["path"] != "combine")
    assert float((out - whole).abs().max()) < 2e-2


@pytest.mark.parametrize("case", [
    dict(sides="kv", kind="hadamard"), dict(sides="k", kind="hadamard"), dict(sides="v", kind="hadamard"),
    dict(sides="kv", kind="pca"), dict(sides="kv", kind="hadamard", d=128, rep=1, k_bits=4, v_bits=4),
    dict(sides="kv", kind="pca", rep=7, k_bits=8, v_bits=2, v_group=64),
    dict(sides="kv", kind="hadamard", k_axis="token", k_group=16),
    dict(sides="kv", kind="hadamard", dtype=torch.float16), dict(sides="kv", kind="pca", dtype=torch.float32),
    dict(sides="kv", kind="shared"),
], ids=["kv-had", "k-had", "v-had", "kv-pca", "d128-gqa1-4b", "gqa7-k8v2-pca", "token-keys", "fp16", "fp32",
        "kv-shared"])
def test_rotated_sides_pass_the_tolerance_rule(case):
    case = dict(case)
    sides, kind = case.pop("sides"), case.pop("kind")
    case.setdefault("rep", 3)
    args, kw = make_case(**case)
    h, d = args[1].shape[1], args[0].shape[-1]
    rot = {f"{s}_rot": _rotation(kind, h, d, seed=i) for i, s in enumerate(sides)}
    out = check(args, {**kw, **rot})
    plain = da.decode_attention(*args, **kw, config=SMALL)
    assert float((out - plain).abs().max()) > 1e-2, "the rotation changes what the packed tokens hold"


@pytest.mark.parametrize("perm,k_mean,v_mean", [("kv", 16, 8), ("v", 8, 0), ("", 0, 16)], ids=str)
def test_rotation_with_permutation_and_means(perm, k_mean, v_mean):
    """Rotated, then centred and permuted (the codec's order): the kernel scores the means and
    the permuted channels with the rotated query and rotates the value accumulators back after
    the value mean joined them."""
    args, kw = make_case(dtype=torch.float16)
    args, kw = with_perm_mean(args, kw, k_perm="k" in perm, v_perm="v" in perm, k_mean=k_mean, v_mean=v_mean)
    h, d = args[1].shape[1], args[0].shape[-1]
    check(args, {**kw, "k_rot": _rotation("hadamard", h, d, 1), "v_rot": _rotation("pca", h, d, 2)})


def test_bad_rotations_are_refused():
    args, kw = make_case()
    h, d = args[1].shape[1], args[0].shape[-1]
    with pytest.raises(ValueError, match="k_rot"):
        da.decode_attention(*args, **kw, k_rot=(hadamard(d // 2).to(DEVICE), None), config=SMALL)
    with pytest.raises(ValueError, match="v_rot"):
        da.decode_attention(*args, **kw, v_rot=(hadamard(d).to(DEVICE), random_signs(h + 1, d, 0).to(DEVICE)),
                            config=SMALL)


# ---------------------------------------------------------------- the runtime adapter and the flush


def _rotated_codec(cfg: LayerConfig, h: int, d: int, **extra) -> LayerCodec:
    return LayerCodec(cfg, k_rotate=(hadamard(d), random_signs(h, d, 11)), v_rotate=(_orthogonal(h, d, 12), None),
                      **extra)


@pytest.mark.parametrize("extra", [{}, dict(k_center=16, v_center=8), "perm"], ids=["plain", "centred", "permuted"])
def test_triton_path_runs_rotated_layers(extra):
    """A rotated layer goes through the kernel (not the reference) and agrees with the runtime's
    reference attention, which rotates every stored block back."""
    from kvcalib.runtime.triton_path import _reason_unsupported

    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=32, window=16, sinks=2)
    if extra == "perm":
        g = torch.Generator().manual_seed(5)
        extra = {"v_perm": torch.stack([torch.randperm(64, generator=g) for _ in range(2)])}
    layer, q, vis = _filled_layer(cfg, codec=_rotated_codec(cfg, 2, 64, **extra))
    assert layer.n_packed > 0 and _reason_unsupported(q, layer) is None
    out = _kernel_path(q, layer, vis, 64 ** -0.5)
    ref = _reference_path(q, layer, vis, 64 ** -0.5)
    assert out is not None and float((out - ref).abs().max()) < 1e-4


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors reach the kernels only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("center", [0, 8], ids=["plain", "center8"])
def test_rotated_flushes_store_the_reference_bytes(monkeypatch, center):
    """The flush rotates the block (``kernel_encode``'s ``x``) and the quantize-and-pack kernels
    store exactly the bytes of the reference codec, centering included."""
    from tests.unit.test_codec_triton import _Spy, _prompt_then_decode, _run, assert_same_storage

    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=16, window=8, sinks=2)
    state = dict(k_rotate=(hadamard(32), random_signs(3, 32, 1)), v_rotate=(_orthogonal(3, 32, 2), None),
                 k_center=center, v_center=center)
    steps = _prompt_then_decode(45, 17, seed=3)
    ref = _run(monkeypatch, "reference", cfg, steps, pad=11, **state)
    spy = _Spy(monkeypatch)
    tri = _run(monkeypatch, "triton", cfg, steps, pad=11, **state)
    assert spy.key_tokens >= tri.n_packed, "every flushed token went through the kernels"
    assert_same_storage(tri, ref)


def test_triton_path_reads_fixed_grids():
    """Error-bounded sides (a fixed step per column) are stored in the packed layout: the decode
    kernel attends them like min/max groups and agrees with the reference attention."""
    from kvcalib.runtime.triton_path import _reason_unsupported

    cfg = LayerConfig(k_bits=4, v_bits=2, k_group=16, v_group=32, window=16, sinks=2)
    g = torch.Generator().manual_seed(9)
    codec = LayerCodec(cfg, k_step=torch.rand(2, 64, generator=g) * 0.5 + 0.2,
                       v_step=torch.rand(2, 2, generator=g) * 0.5 + 0.5)
    layer, q, vis = _filled_layer(cfg, codec=codec)
    assert layer.n_packed > 0 and _reason_unsupported(q, layer) is None
    out = _kernel_path(q, layer, vis, 64 ** -0.5)
    ref = _reference_path(q, layer, vis, 64 ** -0.5)
    assert out is not None and float((out - ref).abs().max()) < 1e-4
