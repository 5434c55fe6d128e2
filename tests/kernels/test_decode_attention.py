"""Fused decode attention over packed K/V vs its PyTorch reference.

Runs on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set here before any kernel
module is imported) at small shapes, and on CUDA as is; the full-size grid is marked ``gpu``.

Tolerance (STYLE habit 2, flash-attn's rule): ``|kernel - truth| <= 2 * |torch_same_dtype - truth|
+ atol(dtype)``, truth = the reference in float64, ``torch_same_dtype`` = the reference run in the
query's dtype.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

# the interpreter must be chosen before a @triton.jit function is defined
DEVICE, INTERPRET, (da, plan, splits, combine) = kernel_modules(
    "kvcalib_kernels.decode_attention", "kvcalib_kernels.decode.plan", "kvcalib_kernels.decode.splits",
    "kvcalib_kernels.decode.combine")
from kvcalib.quant.uniform import quantize_keys, quantize_values  # noqa: E402
from kvcalib_kernels.reference import decode_attention_reference, decode_attention_reference_in  # noqa: E402

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run through the device tool)")
ATOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
SMALL = da.DecodeConfig(block_n=16, fp_block=16)  # several blocks and chunks at test sizes


def make_case(*, b=2, h=2, rep=4, d=64, n=48, f=(2, 5), k_bits=2, v_bits=2, k_group=16, v_group=32,
              k_axis="channel", dtype=torch.bfloat16, seed=0, device=DEVICE, spare=0):
    """Random packed cache (quantized from random K/V by the reference quantizer) + fp segments.

    ``spare`` > 0 stores the packed tensors inside larger buffers (non-contiguous views, like the
    cache's growable buffers). Returns (args, kwargs) for decode_attention(_reference).
    """
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, n, d, generator=g) * 2 + torch.randn(1, 1, 1, d, generator=g)  # channel offsets
    v = torch.randn(b, h, n, d, generator=g)
    if n:
        qk = quantize_keys(k, k_bits, k_group) if k_axis == "channel" else quantize_values(k, k_bits, k_group)
        qv = quantize_values(v, v_bits, v_group)
        packed = [qk.codes, qk.scale, qk.zero, qv.codes, qv.scale, qv.zero]
        if spare:
            def embed(t):
                rows = t.shape[2]
                big = torch.zeros(*t.shape[:2], rows + spare, t.shape[3], dtype=t.dtype)
                big[:, :, 1:rows + 1] = t
                return big.to(device)[:, :, 1:rows + 1]
            packed = [embed(t) for t in packed]
        else:
            packed = [t.to(device) for t in packed]
    else:
        packed = [None] * 6
    q = (torch.randn(b, h * rep, d, generator=g) * 1.5).to(dtype).to(device)
    segs, pos = [], []
    at = 0
    for i, fl in enumerate(f):
        if fl == 0:
            continue
        fk = (torch.randn(b, h, fl, d, generator=g) * 2).to(dtype).to(device)
        fv = torch.randn(b, h, fl, d, generator=g).to(dtype).to(device)
        segs.append((fk, fv))
        if i == 0:
            pos.append(0)
            at = fl
        else:
            pos.append(at + n)
    kwargs = dict(k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group, k_axis=k_axis,
                  scaling=d ** -0.5, fp_segments=segs, fp_positions=pos,
                  packed_position=f[0] if f and f[0] else 0)
    return (q, *packed), kwargs


def check(args, kwargs, config=SMALL):
    out = da.decode_attention(*args, **kwargs, config=config)
    q = args[0]
    truth = decode_attention_reference_in(torch.float64, *args, **kwargs)
    same = decode_attention_reference_in(q.dtype, *args, **kwargs)
    err = float((out - truth).abs().max())
    torch_err = float((same - truth).abs().max())
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert err <= 2 * torch_err + ATOL[q.dtype], f"kernel error {err:.3g} vs torch {q.dtype} error {torch_err:.3g}"
    return out


# ---------------------------------------------------------------- small grid (CPU interpreter)


@pytest.mark.parametrize("k_bits,v_bits", [(2, 2), (4, 4), (8, 8), (2, 4), (4, 2), (8, 2)],
                         ids=lambda x: f"{x}b")
def test_bits(k_bits, v_bits):
    args, kw = make_case(k_bits=k_bits, v_bits=v_bits)
    check(args, kw)


@pytest.mark.parametrize("case", [
    dict(k_bits=3, v_bits=3),  # folded keys in one group per block, folded value planes
    dict(k_bits=3, v_bits=2, k_axis="token", v_group=16, dtype=torch.float32),  # per-element keys, IEEE
    dict(k_bits=2, v_bits=3, v_group=8, n=32, f=(0, 3)),  # per-element values (groups under a plane)
    dict(k_bits=3, v_bits=3, d=64, rep=4, v_group=64, n=64, config=dict(block_n=32)),  # key-group pairs
    dict(k_bits=3, v_bits=3, d=128, rep=1, b=1, k_group=32, v_group=128, n=32),  # value units, transposed
    dict(k_bits=3, v_bits=8, d=128, rep=2, b=1, h=1, k_group=16, v_group=128, n=48,
         config=dict(block_n=32, num_splits=1)),
    # key rows in halves (K_HSPLIT) with a key group over several blocks (folded planes carried),
    # a permutation (the halves' query channels) and float32 queries (IEEE products, unpack 0)
    dict(k_bits=3, v_bits=2, d=128, rep=2, b=1, h=1, k_group=64, v_group=128, n=64, dtype=torch.float32,
         config=dict(block_n=32, num_splits=1), k_perm=True),
], ids=["k3v3", "k3-token-v2-f32", "v3-per-element", "k3v3-group-pairs", "k3v3-units", "k3v8-halves",
        "k3-hsplit-carried-perm-f32"])
def test_three_bit_codes(case):
    """3-bit codes (a 2-bit planar part, then a 1-bit planar part: kvcalib.quant.packing) on each
    path that reads a code tile: the high tile joins the low one in the unpack, so the folds see
    2-bit planes of codes 0..7. (unpack 6 here; on a GPU 3-bit value units take the PTX block (5).)"""
    case = dict(case)
    config = replace(SMALL, **case.pop("config", {}))
    k_perm = case.pop("k_perm", False)
    args, kw = make_case(**case)
    if k_perm:
        args, kw = with_perm_mean(args, kw, k_perm=True)
    meta = _meta(args, kw, config)
    assert (meta["K_HI"], meta["V_HI"]) == (kw["k_bits"] == 3, kw["v_bits"] == 3)
    check(args, kw, config)


def test_three_bit_paths_are_the_ones_named():
    """The cases above reach the paths their names say (so a rule change cannot silently skip one)."""
    def meta(**case):
        config = replace(SMALL, **case.pop("config", {}))
        args, kw = make_case(**case)
        return _meta(args, kw, config)
    assert meta(k_bits=3, v_bits=3, d=64, rep=4, v_group=64, n=64, config=dict(block_n=32))["K_SUB"] == 2
    units = meta(k_bits=3, v_bits=3, d=128, rep=1, b=1, k_group=32, v_group=128, n=32)
    assert units["V_UNITS"] and units["V_T"]
    # its rows are 24 int16 units: the kernel is told they start at multiples of 8 (V_ROW8), which
    # triton cannot see; 2-bit rows (16 units) need no telling, so their kernel stays as it was
    assert units["V_ROW8"]
    assert not meta(k_bits=3, v_bits=2, d=128, rep=1, b=1, k_group=32, v_group=128, n=32)["V_ROW8"]
    # and their high tile comes in two loads masked by column (V_HPAIR: no column-dependent select
    # between the loads and the products); 2-bit values have no high tile
    assert units["V_HPAIR"]
    assert not meta(k_bits=3, v_bits=2, d=128, rep=1, b=1, k_group=32, v_group=128, n=32)["V_HPAIR"]
    assert not meta(k_bits=2, v_bits=3, v_group=8, n=32, f=(0, 3))["V_FOLD"]
    halves = meta(k_bits=3, v_bits=8, d=128, rep=2, b=1, h=1, k_group=16, v_group=128, n=48,
                  config=dict(block_n=32, num_splits=1))
    assert halves["K_HALVES"] and not halves["K_HSPLIT"]  # (plan.THREE_BIT_KEY_HALVES: slower there offline)
    # 3-bit folded keys from head_dim 128 read their rows in halves (K = P / 2 >= 16 for tl.dot);
    # head_dim 64, per-token keys and 2-bit keys keep one (N, P) tile
    assert units["K_HSPLIT"]
    assert meta(k_bits=3, v_bits=2, d=128, rep=2, b=1, h=1, k_group=64, v_group=128, n=64, dtype=torch.float32,
                config=dict(block_n=32, num_splits=1))["K_HSPLIT"]
    assert not meta(k_bits=3, v_bits=3)["K_HSPLIT"]  # head_dim 64
    assert not meta(k_bits=3, v_bits=2, k_axis="token", v_group=16, dtype=torch.float32)["K_HSPLIT"]
    assert not meta(k_bits=2, v_bits=3, d=128, rep=1, b=1, k_group=32, v_group=128, n=32)["K_HSPLIT"]


@pytest.mark.parametrize("rep", [1, 3, 4, 7], ids=lambda r: f"gqa{r}")
def test_gqa_ratios_head_dim_128(rep):
    args, kw = make_case(rep=rep, d=128, h=1, b=1, k_bits=2, v_bits=4, v_group=64, dtype=torch.float16)
    check(args, kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_query_dtypes(dtype):
    args, kw = make_case(dtype=dtype, k_bits=4, v_bits=2)
    check(args, kw)


@pytest.mark.parametrize("unpack", [0, 1, 6], ids=lambda u: f"unpack{u}")
def test_unpack_modes(unpack):
    args, kw = make_case(k_bits=2, v_bits=8, v_group=64)
    check(args, kw, da.DecodeConfig(block_n=16, fp_block=16, unpack=unpack))


def _meta(args, kw, config) -> dict:
    """The launch options and constexprs the launcher picks for this case (the grouped code paths
    read back one per path: plan.split_fields)."""
    part = {**da._PART_DEFAULTS, **dict(zip(da._PACKED_NAMES, args[1:])), **kw}
    return plan.split_fields(plan._prepare(args[0], **part, config=config).meta)


def _v_units_chosen(args, kw, config) -> bool:
    """Whether the kernel reads this case's value codes as int16 units (the launcher's rule)."""
    return _meta(args, kw, config)["V_UNITS"]


@pytest.mark.parametrize("case", [
    dict(d=128, v_bits=2, v_group=128), dict(d=128, v_bits=4, v_group=128), dict(d=128, v_bits=8, v_group=128),
    dict(d=64, v_bits=4, v_group=64), dict(d=64, v_bits=8, v_group=64, spare=3),
    dict(d=128, v_bits=2, v_group=128, perm=True), dict(d=128, v_bits=4, v_group=128, perm=True, mean=8),
    dict(d=128, v_bits=4, v_group=32), dict(d=128, v_bits=8, v_group=32), dict(d=128, v_bits=8, v_group=64),
    dict(d=128, v_bits=4, v_group=32, perm=True, mean=8), dict(d=128, v_bits=4, v_group=32, mean=16, spare=2),
], ids=["d128-2b", "d128-4b", "d128-8b", "d64-4b", "d64-8b-views", "d128-2b-perm", "d128-4b-perm-mean8",
        "d128-4b-g32", "d128-8b-g32", "d128-8b-g64", "d128-4b-g32-perm-mean8", "d128-4b-g32-mean16-views"])
def test_value_units_pass_the_tolerance_rule(case):
    """Value codes read as int16 units (two bytes each, unpacked elementwise into both bytes'
    planes, two accumulators per plane) pass the tolerance rule; with SKVQ permutations (and
    TaDA means beside them) and strided views too."""
    case = dict(case)
    perm, mean = case.pop("perm", False), case.pop("mean", 0)
    args, kw = make_case(k_bits=2, dtype=torch.float16, b=2, h=2, rep=3, n=80, **case)
    d = case["d"]
    g = torch.Generator().manual_seed(5)
    if perm:
        kw["v_perm"] = torch.stack([torch.randperm(d, generator=g) for _ in range(2)]).to(DEVICE)
    if mean == 16:
        kw["v_mean"] = torch.randn(2, 1, 80, d, generator=g).half().to(DEVICE)
    elif mean:
        vm = torch.randn(2, 1, 80, d, generator=g)
        lo, hi = vm.amin(-1, keepdim=True), vm.amax(-1, keepdim=True)
        scale = ((hi - lo) / 255).half()
        codes = ((vm - lo) / scale.float()).round().clamp(0, 255).to(torch.uint8)
        kw["v_mean"] = (codes.to(DEVICE), scale.to(DEVICE), lo.half().to(DEVICE))
    units = replace(SMALL, unpack=6)
    assert _v_units_chosen(args, kw, units)
    check(args, kw, units)


@pytest.mark.parametrize("case", [
    dict(d=128, v_bits=2, v_group=128), dict(d=128, v_bits=4, v_group=64), dict(d=128, v_bits=8, v_group=128),
    dict(d=128, v_bits=2, v_group=64, perm=True), dict(d=64, v_bits=2, v_group=32, unpack=6),
    dict(d=64, v_bits=4, v_group=64, pairs=True), dict(d=128, v_bits=4, v_group=128, unpack=1),
    dict(d=128, v_bits=2, v_group=128, mean=True),
], ids=["d128-2b", "d128-4b-g64", "d128-8b", "d128-2b-g64-perm", "d64-2b-g32-bytes", "d64-4b-pairs",
        "d128-4b-no-lanes", "d128-2b-mean"])
def test_value_sums_by_products_and_by_reductions(case):
    """Folded value planes take their lane terms by products at 2 bits with one key group per
    block, by reductions elsewhere (the launcher's rule), and pass the tolerance rule either way:
    one group per head, a group per plane, planes sharing a group with others apart (2-bit g64 /
    g32), 8 bits, byte tiles, two key groups per block, no lanes, a permutation, a TaDA value mean."""
    case = dict(case)
    perm, mean, pairs = case.pop("perm", False), case.pop("mean", False), case.pop("pairs", False)
    cfg = replace(SMALL, unpack=case.pop("unpack", 6))
    if pairs:
        cfg = replace(cfg, block_n=32)  # head_dim 64, 3 query rows: two key groups of 16 per block
    args, kw = make_case(k_bits=2, dtype=torch.float16, b=2, h=2, rep=3, n=80, **case)
    g = torch.Generator().manual_seed(6)
    if perm:
        kw["v_perm"] = torch.stack([torch.randperm(case["d"], generator=g) for _ in range(2)]).to(DEVICE)
    if mean:
        kw["v_mean"] = torch.randn(2, 1, 80, case["d"], generator=g).half().to(DEVICE)
    meta = _meta(args, kw, cfg)
    assert meta["V_FOLD"] and meta["V_NCH"] == 1 and meta["K_SUB"] == (2 if pairs else 1)
    assert meta["V_SUM_DOTS"] == (case["v_bits"] == 2 and not pairs)
    check(args, kw, cfg)


@pytest.mark.parametrize("case", [
    dict(d=128, k_bits=2, v_bits=2, v_group=128, k_group=32), dict(d=128, k_bits=2, v_bits=2, v_group=64, k_group=16),
    dict(d=128, k_bits=4, v_bits=4, v_group=128, k_group=64), dict(d=128, k_bits=4, v_bits=4, v_group=32, k_group=32),
    dict(d=64, k_bits=8, v_bits=8, v_group=32, k_group=32), dict(d=128, k_bits=2, v_bits=2, v_group=128, k_group=32,
                                                                  start=True),
], ids=["2b-g128", "2b-g64", "4b-g128", "4b-g32", "d64-8b-g32", "2b-range"])
def test_early_value_scales(case):
    """Per-token value scales and zeros loaded at the top of each block, before the key work
    (values of <= 4 bits; 8-bit values load them at use), pass the tolerance rule: value groups
    per head, per plane (2-bit g64) and per chunk (value-group accumulators: 4-bit g32; 8-bit
    g32), folded sums by products and by reductions (4-bit g128), splits and a packed range
    starting inside a key group."""
    case = dict(case)
    start = case.pop("start", False)
    args, kw = make_case(dtype=torch.float16, b=2, h=2, rep=3, n=192, **case)
    if start:
        kw["packed_start"] = torch.tensor([0, 40], device=DEVICE)
    early = replace(SMALL, unpack=6, num_splits=4)  # 12 blocks of 16: splits at 0, 48, 96, 144
    meta = _meta(args, kw, early)
    assert meta["V_EARLY"] == (case["v_bits"] <= 4)  # (8-bit values: at use, plan._early_value_scales)
    assert meta["K_FOLD"] and (meta["V_FOLD"] or meta["V_NCH"] > 1)
    check(args, kw, early)


def test_deep_pipeline_rule():
    """One more pipeline stage only where every split runs >= deep_pipeline_blocks blocks of a
    layout of <= 4 bits folding one key group per block, one value accumulator per plane, no TaDA
    means."""
    cfg = replace(SMALL, unpack=6)
    assert plan._stages(cfg.num_stages, 16, True) == cfg.num_stages + 1
    assert plan._stages(cfg.num_stages, 15, True) == cfg.num_stages
    assert plan._stages(cfg.num_stages, 64, False) == cfg.num_stages

    def stages(config, **case):
        args, kw = make_case(k_bits=2, dtype=torch.float16, b=1, h=2, rep=2, n=512, d=128, **case)
        return _meta(args, kw, config)["num_stages"]

    one = replace(cfg, num_splits=1)  # 32 blocks of 16 tokens in the split
    assert stages(one, v_bits=2, k_group=16, v_group=128) == cfg.num_stages + 1
    assert stages(replace(cfg, num_splits=8), v_bits=2, k_group=16, v_group=128) == cfg.num_stages  # 4 blocks
    assert stages(one, v_bits=4, k_group=16, v_group=32) == cfg.num_stages  # value-group accumulators
    assert stages(one, v_bits=8, k_group=16, v_group=128) == cfg.num_stages  # 8 bits: shared memory


@requires_cuda
@pytest.mark.parametrize("v_bits", [2, 4])
def test_deep_pipeline_matches_two_stages(v_bits):
    """The extra pipeline stage changes when code tiles arrive, not the arithmetic: on the GPU the
    result equals the two-stage kernel's bit for bit (splits of 32 blocks of 64 tokens; num_stages=1
    is the two-stage kernel there: the rule adds its stage to the config's)."""
    args, kw = make_case(k_bits=v_bits, v_bits=v_bits, dtype=torch.bfloat16, b=2, h=2, rep=4, n=4096, d=128,
                         k_group=128, v_group=128)
    deep = da.DecodeConfig(num_splits=2)
    two = replace(deep, num_stages=1)
    assert _meta(args, kw, deep)["num_stages"] == 3 and _meta(args, kw, two)["num_stages"] == 2
    out = check(args, kw, deep)
    assert torch.equal(out, da.decode_attention(*args, **kw, config=two))


def test_value_sum_products_default_rule():
    """By default the products take the lane terms of 2-bit folded values with one key group per
    block only (where they measured faster); not at 4 / 8 bits nor with two key groups per block."""
    def chosen(config, **case):
        args, kw = make_case(k_bits=2, dtype=torch.float16, **case)
        return _meta(args, kw, config)["V_SUM_DOTS"]

    cfg = replace(SMALL, unpack=6)
    assert chosen(cfg, d=128, v_bits=2, v_group=128, k_group=16)
    assert not chosen(cfg, d=128, v_bits=4, v_group=128, k_group=16)
    assert not chosen(cfg, d=128, v_bits=8, v_group=128, k_group=16)
    pairs = replace(cfg, block_n=32)  # head_dim 64, 4 query rows: two key groups of 16 per block
    assert not chosen(pairs, d=64, v_bits=2, v_group=64, k_group=16)


def test_value_units_where_they_apply():
    """Byte tiles stay for rows of fewer than 32 code bytes (2-bit head_dim 64), value groups of
    fewer than 32 channels (16 units: tl.dot's smallest N), two key groups per block, and a value
    mean without a permutation on a whole-plane layout (the last two measured slower with units);
    the launcher never combines what the kernel refuses."""
    cfg = replace(SMALL, unpack=6)
    args, kw = make_case(d=64, v_bits=2, v_group=64, dtype=torch.float16)
    assert not _v_units_chosen(args, kw, cfg)
    args, kw = make_case(d=128, v_bits=4, v_group=32, dtype=torch.float16)
    assert _v_units_chosen(args, kw, cfg)  # value groups narrower than a plane: units per group
    args, kw = make_case(d=64, v_bits=4, v_group=16, dtype=torch.float16)
    assert not _v_units_chosen(args, kw, cfg)  # 8 units per group
    check(args, kw, cfg)
    args, kw = make_case(d=64, v_bits=4, v_group=64, dtype=torch.float16)
    assert _v_units_chosen(args, kw, cfg)
    pairs = replace(cfg, block_n=32)  # two key groups of 16 per block (head_dim 64, 4 query rows)
    assert _meta(args, kw, pairs)["K_SUB"] == 2 and not _v_units_chosen(args, kw, pairs)
    check(args, kw, pairs)
    mean = torch.randn(2, 1, 48, 64).half().to(DEVICE)
    assert not _v_units_chosen(args, {**kw, "v_mean": mean}, cfg)
    check(args, {**kw, "v_mean": mean}, cfg)


@pytest.mark.parametrize("case", [
    dict(d=128, k_bits=2, v_bits=2, v_group=128), dict(d=128, k_bits=4, v_bits=4, v_group=128),
    dict(d=128, k_bits=8, v_bits=8, v_group=128), dict(d=128, k_bits=2, v_bits=4, v_group=64),
    dict(d=64, k_bits=4, v_bits=4, v_group=64, rep=7), dict(d=128, k_bits=2, v_bits=2, v_group=128, perm=True),
    dict(d=128, k_bits=4, v_bits=2, v_group=128, k_group=32, halves=True),
    dict(d=128, k_bits=2, v_bits=2, v_group=128, start=True, spare=2),
    dict(d=128, k_bits=4, v_bits=4, v_group=32), dict(d=128, k_bits=8, v_bits=8, v_group=32, perm=True),
    dict(d=128, k_bits=4, v_bits=4, v_group=32, k_group=32, halves=True),
], ids=["2b", "4b", "8b", "k2v4-g64", "d64-4b-gqa7", "2b-perm", "4b-keys32-halves", "2b-range-views",
        "4b-g32-chunks", "8b-g32-chunks-perm", "4b-g32-chunks-halves"])
def test_value_products_t(case):
    """Transposed value products (codes^T @ (p * scale) into (channels, rows) accumulators) pass
    the tolerance rule: 2/4/8 bits, a value group per plane pair (4-bit g64), head_dim 64 with 7
    query rows, an SKVQ permutation, two key groups per block in halves, a packed range and
    strided views, and value groups narrower than a plane (value-group accumulators, their zeros by
    one product); value-group accumulators of <= 4 bits beside keys in halves keep the
    untransposed products (the launcher's rule)."""
    case = dict(case)
    perm, halves, start = case.pop("perm", False), case.pop("halves", False), case.pop("start", False)
    case.setdefault("k_group", 16)
    args, kw = make_case(dtype=torch.float16, b=2, h=2, n=96, **{"rep": 3, **case})
    if perm:
        g = torch.Generator().manual_seed(7)
        kw["v_perm"] = torch.stack([torch.randperm(case["d"], generator=g) for _ in range(2)]).to(DEVICE)
    if start:
        kw["packed_start"] = torch.tensor([0, 21], device=DEVICE)
    on = replace(SMALL, unpack=6, num_splits=2)
    if halves:
        on = replace(on, block_n=64)  # keys of 32 in the halves of 64-token blocks
    meta = _meta(args, kw, on)
    chunks_beside_halves = meta["V_NCH"] > 1 and halves and case["v_bits"] <= 4
    assert meta["V_T"] == (not chunks_beside_halves) and meta["V_UNITS"]
    assert meta["K_HALVES"] == halves
    check(args, kw, on)


@pytest.mark.parametrize("case", [
    dict(d=128, v_bits=2, v_group=128), dict(d=128, v_bits=4, v_group=16), dict(d=128, v_bits=4, v_group=32),
    dict(d=128, k_bits=4, v_bits=4, k_group=32, v_group=32, n=512, blocks=64), dict(d=128, v_bits=8, v_group=64, spare=3),
    dict(d=128, v_bits=4, v_group=64, k_axis="token"), dict(d=128, k_bits=2, v_bits=2, v_group=64, rep=6),
])
def test_whole_blocks_match_masked(case):
    """Calls whose packed blocks are all whole and visible run the loop without bounds masks and
    give the masked loop's result exactly (the same call with a packed range of all tokens):
    folded value planes read as units (2-bit g128), per-element values (4-bit g16), value-group
    chunks (4-bit g32), keys in block halves, strided views, per-token keys, 8 padded query rows
    at 2 bits."""
    case = dict(case)
    block_n = case.pop("blocks", 16)
    args, kw = make_case(dtype=torch.float16, b=2, h=2, **{"n": 96, "rep": 3, **case})
    on = replace(SMALL, unpack=6, num_splits=2, block_n=block_n)
    masked = {**kw, "packed_start": torch.zeros(2, dtype=torch.int32, device=DEVICE)}
    meta = _meta(args, kw, on)
    assert meta["WHOLE"] and not _meta(args, masked, on)["WHOLE"]
    assert meta["K_HALVES"] == (block_n == 64)
    out = check(args, kw, on)
    assert torch.equal(out, da.decode_attention(*args, **masked, config=on))


def test_whole_blocks_only_where_every_block_is_whole():
    """A packed length that is not a multiple of the block, a packed range or a mask over the
    packed tokens keep the bounds masks (and their results pass the rule); a mask over the
    full-precision tokens only does not."""
    cfg = replace(SMALL, unpack=6, num_splits=2)
    args, kw = make_case(dtype=torch.float16, n=80, d=128, rep=3)  # 2.5 blocks of 32
    assert not _meta(args, kw, replace(cfg, block_n=32))["WHOLE"] and _meta(args, kw, cfg)["WHOLE"]
    check(args, kw, replace(cfg, block_n=32))
    args, kw = make_case(dtype=torch.float16, n=96, d=128, rep=3)
    assert _meta(args, kw, cfg)["WHOLE"]
    start = {**kw, "packed_start": torch.tensor([0, 21], device=DEVICE)}
    assert not _meta(args, start, cfg)["WHOLE"]
    check(args, start, cfg)
    length = kw["fp_positions"][-1] + kw["fp_segments"][-1][0].shape[2]
    mask = torch.ones(2, length, dtype=torch.bool, device=DEVICE)
    mask[1, 5] = False
    masked = {**kw, "mask": mask}
    assert not _meta(args, masked, cfg)["WHOLE"]
    check(args, masked, cfg)
    assert _meta(args, {**masked, "mask_packed": False}, cfg)["WHOLE"]  # (the mask then covers the fp tokens only)


def test_whole_blocks_default_rule():
    """By default (whole_blocks None) unmasked whole blocks at head_dim 128 with <= 4 padded query
    rows, or at 2 bits; not at head_dim 64 nor with 8 padded rows at 4 bits (measured slower)."""
    cfg = replace(SMALL, unpack=6, num_splits=2)
    for d, rep_, bits, want in ((128, 4, 4, True), (128, 3, 2, True), (128, 6, 2, True), (128, 6, 4, False),
                                (64, 4, 2, False), (64, 3, 4, False)):
        args, kw = make_case(dtype=torch.float16, d=d, rep=rep_, k_bits=bits, v_bits=bits, v_group=32, n=96)
        assert _meta(args, kw, cfg)["WHOLE"] == want, (d, rep_, bits)


def test_value_products_t_where_they_apply():
    """Values read as bytes (2-bit head_dim 64: rows of 16 bytes; 4-bit groups of 16: 8 units per
    group) and a TaDA value mean keep the untransposed products; the results of those cases still
    pass the rule. Value-group accumulators read as units take the transposed ones, by default
    not at <= 4 bits beside keys in block halves (measured no faster there)."""
    cfg = replace(SMALL, unpack=6)
    args, kw = make_case(d=64, v_bits=2, v_group=64, dtype=torch.float16)
    assert not _meta(args, kw, cfg)["V_UNITS"] and not _meta(args, kw, cfg)["V_T"]
    args, kw = make_case(d=64, v_bits=4, v_group=16, dtype=torch.float16)
    meta = _meta(args, kw, cfg)
    assert meta["V_NCH"] > 1 and not meta["V_UNITS"] and not meta["V_T"]
    check(args, kw, cfg)
    args, kw = make_case(d=128, v_bits=4, v_group=32, dtype=torch.float16)
    meta = _meta(args, kw, cfg)
    assert meta["V_NCH"] > 1 and meta["V_T"] and not meta["K_HALVES"]
    blocks64 = replace(cfg, block_n=64, num_splits=2)  # splits of several blocks: keys of 32 in halves
    for v_bits, transposed in ((4, False), (8, True)):
        args, kw = make_case(d=128, k_bits=v_bits, v_bits=v_bits, v_group=32, k_group=32, n=512, dtype=torch.float16)
        meta = _meta(args, kw, blocks64)
        assert meta["K_HALVES"] and meta["V_NCH"] > 1 and meta["V_T"] == transposed
    args, kw = make_case(d=128, v_bits=2, v_group=128, dtype=torch.float16)
    assert _meta(args, kw, cfg)["V_T"]
    mean = torch.randn(2, 1, 48, 128).half().to(DEVICE)
    assert not _meta(args, {**kw, "v_mean": mean}, cfg)["V_T"]
    check(args, {**kw, "v_mean": mean}, cfg)


def test_few_rows_split_finer():
    """Few (batch, kv head) rows: one block per split (below ``min_programs`` programs), and
    shorter blocks (``plan.SMALL_BLOCK_N``) when even that leaves few programs; results unchanged."""
    cpu = torch.device("cpu")  # 4 "SMs" off CUDA: 64 programs per row pair at most
    coarse = splits.SplitRule(min_splits=1, min_programs=0, programs_per_sm=16)
    fine = splits.SplitRule(min_splits=1, programs_per_sm=16)
    assert splits._split_plan(64 * 20, 64, [], 64, 1, 2, cpu, coarse)[:2] == (10, 128)  # 2 blocks per split
    assert splits._split_plan(64 * 20, 64, [], 64, 1, 2, cpu, fine)[:2] == (20, 64)  # 1 block per split
    assert splits._split_plan(64 * 20, 64, [], 64, 8, 8, cpu, fine)[:2] == (1, 64 * 20)  # many rows: as before
    args, kw = make_case(b=1, h=2, n=96, k_group=32, v_group=32, k_bits=2, v_bits=4, f=(2, 5))
    assert _meta(args, kw, da.DecodeConfig())["BLOCK_N"] == plan.SMALL_BLOCK_N  # 64-token blocks -> 32
    check(args, kw, da.DecodeConfig())
    # 8-bit blocks cost more: shorter blocks below min_programs programs, not half of it (1 x 2
    # heads x 192 blocks of 64 tokens = 384 programs, between half of min_programs and all of it)
    assert plan.SplitRule().min_programs // 2 <= 2 * 192 < plan.SplitRule().min_programs
    for bits, want in ((2, 64), (8, 32)):
        args, kw = make_case(b=1, h=2, n=64 * 192, k_group=32, v_group=32, k_bits=bits, v_bits=bits, f=(2, 5))
        assert _meta(args, kw, da.DecodeConfig())["BLOCK_N"] == want, bits
    for bits in (2, 8):  # 12 blocks of 32: short blocks at either width, results unchanged
        args, kw = make_case(b=1, h=2, n=384, k_group=32, v_group=32, k_bits=bits, v_bits=bits, f=(2, 5))
        assert _meta(args, kw, da.DecodeConfig())["BLOCK_N"] == 32, bits
        check(args, kw, da.DecodeConfig())


def test_splits_fill_whole_waves():
    """The packed split programs of all rows stay within programs_per_sm x SMs (rounded down per
    row): 3 rows over 4 "SMs" at 8 per SM get 10 splits each (30 programs), not 11 (33, a
    program past the wave)."""
    cpu = torch.device("cpu")
    n = 64 * 110  # 110 blocks: room for either count
    assert splits._split_plan(n, 64, [], 64, 1, 3, cpu, plan._split_rule(da.DecodeConfig()))[0] == 10
    assert splits._split_plan(n, 64, [], 64, 1, 3, cpu, splits.SplitRule(whole_waves=False))[0] == 11
    assert splits._split_plan(n, 64, [], 64, 1, 64, cpu, splits.SplitRule())[0] == 1  # never below one


@pytest.mark.parametrize("rep", [3, 7, 1, 4, 6], ids=str)
def test_small_row_tiles(rep):
    """Query tiles of fewer than 16 rows (the GQA group padded to a power of two >= plan.MIN_ROWS)."""
    args, kw = make_case(rep=rep, k_bits=4, v_bits=2, dtype=torch.float16)
    assert _meta(args, kw, SMALL)["R_PAD"] == max(plan.MIN_ROWS, 1 << (rep - 1).bit_length())
    check(args, kw, SMALL)


@pytest.mark.parametrize("field,bad", [("block_n", 24), ("fp_block", 8), ("num_warps", 3), ("num_stages", 0),
                                       ("unpack", 3), ("programs_per_sm", 0), ("num_splits", 0)])
def test_config_rejects_bad_values(field, bad):
    with pytest.raises(ValueError, match=field):
        da.DecodeConfig(**{field: bad})


@pytest.mark.parametrize("splits", [1, 2, 3], ids=lambda s: f"splits{s}")
def test_split_counts_give_the_same_answer(splits):
    args, kw = make_case(n=64, b=1)
    check(args, kw, da.DecodeConfig(block_n=16, fp_block=16, num_splits=splits))


def test_splits_and_padding_start_inside_a_key_group():
    """Key groups longer than a block: a split or a padded batch row may start mid-group."""
    args, kw = make_case(b=2, n=96, k_group=32, k_bits=4, v_bits=2)
    start = torch.tensor([0, 20], device=DEVICE)
    check(args, {**kw, "packed_start": start}, da.DecodeConfig(block_n=16, fp_block=16, num_splits=2))


def test_per_batch_range_not_a_multiple_of_the_block():
    """Ragged batch / left padding: packed tokens [start_b, end_b), ends off the block grid."""
    args, kw = make_case(b=3, n=48)
    start = torch.tensor([0, 5, 17], device=DEVICE)
    end = torch.tensor([48, 23, 18], device=DEVICE)  # 48, 18 and 1 valid packed tokens
    check(args, {**kw, "packed_start": start, "packed_end": end})


def test_device_range_spreads_a_rows_blocks_over_the_planned_splits():
    """A range on the device (a stable launch reads a store's whole allocation): each row's live
    blocks are shared by all planned splits, more splits than a short row has blocks leave some
    empty, and an end past the packed tokens is clamped in the kernel."""
    args, kw = make_case(b=3, n=96, k_group=32, k_bits=2, v_bits=2)
    start = torch.tensor([0, 20, 0], dtype=torch.int32, device=DEVICE)
    end = torch.tensor([96, 40, 500], dtype=torch.int32, device=DEVICE)  # 96, 20 and (clamped) 96 tokens
    for splits in (2, 5):
        check(args, {**kw, "packed_start": start, "packed_end": end},
              da.DecodeConfig(block_n=16, fp_block=16, num_splits=splits))


def test_one_packed_token_per_token_keys():
    """k_axis='token' flushes single tokens: N = 1 packed token."""
    args, kw = make_case(n=1, k_axis="token", k_group=32, k_bits=4, v_bits=4, b=1)
    check(args, kw)


def test_window_only_nothing_packed():
    args, kw = make_case(n=0, f=(0, 7))
    check(args, kw)


def test_sinks_and_window_with_padding_mask():
    """A mask over absolute positions hides left padding in the sinks, packed and window parts."""
    args, kw = make_case(b=2, n=32, f=(3, 6))
    total = 3 + 32 + 6
    mask = torch.ones(2, total, dtype=torch.bool)
    mask[1, :20] = False  # batch 1: 20 padding positions (sinks + part of the packed tokens)
    mask[0, 3 + 7] = False  # a hole
    mask[0, total - 2] = False
    check(args, {**kw, "mask": mask.to(DEVICE)})


def test_fully_masked_rows_are_zero():
    args, kw = make_case(b=2, n=32, f=(0, 4))
    mask = torch.ones(2, 36, dtype=torch.bool)
    mask[0] = False
    out = check(args, {**kw, "mask": mask.to(DEVICE)})
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("d,v_bits,v_group,chunks", [(64, 4, 16, 2), (64, 8, 16, 4), (128, 8, 64, 2), (128, 4, 16, 0)],
                         ids=str)
def test_small_value_groups_and_token_keys(d, v_bits, v_group, chunks):
    """v_group smaller than a plane: at most 4 value groups per head fold per (plane, chunk of
    v_group byte columns), one accumulator per group; more groups (and per-token keys) dequantize
    per element."""
    layout = plan._plan(d, 4, 4, v_bits, 16, v_group, "token", torch.bfloat16, torch.bfloat16, "cpu", 0, SMALL, True)
    assert (layout.v_fold, layout.v_chunks) == ((True, chunks) if chunks else (False, 1))
    args, kw = make_case(k_axis="token", k_group=16, k_bits=4, v_bits=v_bits, v_group=v_group, n=40, d=d)
    check(args, kw)


@pytest.mark.parametrize("k_bits,v_bits", [(2, 2), (4, 4)], ids=lambda x: f"{x}b")
def test_key_groups_shorter_than_a_block_run_in_pairs(k_bits, v_bits):
    """Per-channel key groups of half a block run two per block (virtual query rows, one set per
    key group, merged at the end; head_dim 64, 4 query rows, <= 4 bits): within the tolerance,
    and near blocks of one group, on ragged ranges, a mask, and a length whose last block has an
    empty second half."""
    cfg = da.DecodeConfig(block_n=32, fp_block=16)
    layout = plan._plan(64, 4, k_bits, v_bits, 16, 32, "channel", torch.float16, torch.float16, "cpu", 0, cfg, True)
    assert layout.block_n == 32 and not layout.k_halves  # two 16-token key groups per block, as virtual rows
    assert plan._plan(64, 4, k_bits, v_bits, 16, 32, "channel", torch.float16, torch.float16, "cpu", 0,
                      replace(cfg, block_n=16), True).block_n == 16
    args, kw = make_case(k_bits=k_bits, v_bits=v_bits, k_group=16, n=80, dtype=torch.float16, f=(2, 5))
    mask = torch.ones(2, 87, dtype=torch.bool)
    mask[1, 30:41] = False
    kw = {**kw, "packed_start": torch.tensor([0, 7], device=DEVICE), "packed_end": torch.tensor([80, 55], device=DEVICE),
          "mask": mask.to(DEVICE)}
    assert _meta(args, kw, cfg)["K_SUB"] == 2
    pairs = check(args, kw, cfg)
    single = check(args, kw, replace(cfg, block_n=16))
    assert float((pairs - single).abs().max()) < 5e-3


@pytest.mark.parametrize("k_bits,v_bits,v_group,d", [(2, 2, 32, 128), (4, 4, 16, 128), (8, 4, 64, 64)], ids=str)
def test_key_groups_shorter_than_a_block_run_in_halves(k_bits, v_bits, v_group, d, monkeypatch):
    """Two per-channel key groups per block, one per half, each half's codes times its own folded
    query planes (no virtual rows; where the pairs rule is off): within the tolerance and near
    blocks of one group, on ragged ranges, a mask, splits, and a length whose last block has an
    empty second half (its parameter row is past the end: clamped, the half masked)."""
    cfg = da.DecodeConfig(block_n=32, fp_block=16, num_splits=3)
    layout = plan._plan(d, 4, k_bits, v_bits, 16, v_group, "channel", torch.float16, torch.float16, "cpu", 0, cfg,
                        True)
    assert layout.block_n == 32 and layout.k_halves
    single_cfg = replace(cfg, block_n=16)
    assert plan._plan(d, 4, k_bits, v_bits, 16, v_group, "channel", torch.float16, torch.float16, "cpu", 0,
                      cfg, True, halves=False).block_n == 16
    args, kw = make_case(k_bits=k_bits, v_bits=v_bits, k_group=16, v_group=v_group, n=80, dtype=torch.float16, d=d)
    mask = torch.ones(2, 87, dtype=torch.bool)
    mask[1, 30:41] = False
    kw = {**kw, "packed_start": torch.tensor([0, 7], device=DEVICE), "packed_end": torch.tensor([80, 55], device=DEVICE),
          "mask": mask.to(DEVICE)}
    halves = check(args, kw, cfg)
    single = check(args, kw, single_cfg)
    assert float((halves - single).abs().max()) < 5e-3
    args, kw = make_case(k_bits=k_bits, v_bits=v_bits, k_group=16, v_group=v_group, n=48, dtype=torch.float16,
                         rep=3, d=d)  # 1.5 blocks: the last block's second half is past the end
    check(args, kw, replace(cfg, num_splits=1))
    assert _meta(args, kw, replace(cfg, num_splits=1))["K_HALVES"]
    # one block per split: one key group per block where that gives >= 1.5x the splits (2 -> 3
    # here), and no more than HALVES_MAX_SPLITS of them; halves where it gives no more (2 -> 2)
    auto = replace(cfg, num_splits=None)
    assert not _meta(args, kw, auto)["K_HALVES"]
    assert _meta(args, kw, replace(cfg, num_splits=2))["K_HALVES"]
    monkeypatch.setattr(plan, "HALVES_MAX_SPLITS", 2)
    assert _meta(args, kw, auto)["K_HALVES"]
    monkeypatch.setattr(plan, "HALVES_MAX_SPLITS", 256)
    monkeypatch.setattr(plan, "HALVES_SPLIT_GAIN", 2.0)
    assert _meta(args, kw, auto)["K_HALVES"]


def test_key_group_pairs_default_rule():
    """32-token key groups run as pairs of virtual row sets only where it measured faster: head_dim
    <= 64, <= 4 padded query rows, <= 4 bits (blocks of one key group where halves are off)."""
    cfg = da.DecodeConfig()

    def block_n(d, rep, bits, k_group=32):
        return plan._plan(d, rep, bits, bits, k_group, 32, "channel", torch.float16, torch.float16, "cpu", 0, cfg,
                          True, halves=False).block_n
    assert block_n(64, 3, 4) == 64 and block_n(64, 4, 2) == 64  # SmolLM2-like: two key groups per block
    assert block_n(128, 4, 4) == 32 and block_n(64, 6, 4) == 32 and block_n(64, 3, 8) == 32
    assert block_n(64, 3, 4, k_group=128) == 64 and block_n(64, 3, 4, k_group=16) == 32
    # elsewhere two groups run in the halves of a block
    layout = plan._plan(128, 4, 4, 4, 32, 32, "channel", torch.float16, torch.float16, "cpu", 0, cfg, True)
    assert layout.block_n == 64 and layout.k_halves
    assert block_n(64, 3, 4) == 64 and not plan._plan(64, 3, 4, 4, 32, 32, "channel", torch.float16, torch.float16,
                                                      "cpu", 0, cfg, True).k_halves  # pairs where they apply


@pytest.mark.parametrize("unpack", [1, 6], ids=lambda u: f"unpack{u}")
def test_key_group_pairs_with_value_groups_means_and_odd_gqa(unpack):
    """Two key groups per block beside value-group accumulators (v_group 16 < a 32-byte plane),
    permutations and each mean kind (the value mean accumulated apart), and 3 query heads per kv
    head (a padded row in each virtual row set); 8-bit values take the block halves instead."""
    cfg = da.DecodeConfig(block_n=32, fp_block=16, unpack=unpack, num_splits=2)
    for rep, v_bits, v_group, k_mean, v_mean in ((4, 4, 16, 16, 8), (3, 8, 16, 8, 16), (3, 2, 32, 0, 0)):
        args, kw = make_case(rep=rep, n=80, k_bits=4, v_bits=v_bits, k_group=16, v_group=v_group,
                             dtype=torch.float16)
        args, kw = with_perm_mean(args, kw, k_perm=True, v_perm=True, k_mean=k_mean, v_mean=v_mean)
        kw = {**kw, "packed_start": torch.tensor([3, 0], device=DEVICE), "packed_end": torch.tensor([80, 49], device=DEVICE)}
        meta = _meta(args, kw, cfg)
        assert (meta["K_SUB"], meta["K_HALVES"]) == ((1, True) if v_bits == 8 else (2, False))
        check(args, kw, cfg)


def test_benchmark_names_the_value_path_the_kernel_takes():
    """``benchmarks/groups.py`` labels its rows with the kernel's value path (``value_path``, from
    ``value_fold``, which the launch plan also calls): they must agree on every layout."""
    from benchmarks.groups import value_path

    seen = set()
    for d in (64, 128, 256):
        for bits in (2, 4, 8):
            for vg in (16, 32, 64, 128, 256):
                if d % vg or da.supports(head_dim=d, k_bits=2, v_bits=bits, k_group=16, v_group=vg):
                    continue
                layout = plan._plan(d, 4, 2, bits, 16, vg, "channel", torch.float16, torch.float16, "cpu", 0,
                                    da.DecodeConfig(), True)
                want = ("fold" if layout.v_chunks == 1 else "group-fold") if layout.v_fold else "per-element"
                assert value_path(d, bits, vg) == want, (d, bits, vg)
                seen.add(want)
    assert seen == {"fold", "group-fold", "per-element"}


def test_softcap():
    args, kw = make_case(k_bits=4, v_bits=4)
    check(args, {**kw, "softcap": 5.0})


def test_non_contiguous_inputs():
    args, kw = make_case(spare=9, b=2, n=32)
    q = args[0]
    qnc = torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device=q.device)[..., ::2]
    qnc.copy_(q)  # strided last dim: the launcher makes it contiguous
    check((qnc, *args[1:]), kw)
    check(args, kw)


def test_rejects_unsupported_layouts():
    args, kw = make_case(d=64)
    with pytest.raises(ValueError, match="k_group"):
        da.decode_attention(*args, **{**kw, "k_group": 12})
    assert da.supports(head_dim=32, k_bits=2, v_bits=2, k_group=32, v_group=32) is not None
    assert da.supports(head_dim=128, k_bits=2, v_bits=2, k_group=128, v_group=128) is None


# ---------------------------------------------------------------- OTT: quant masks and outlier pools


def with_ott(args, kw, *, keep_block, pool=6, drop=0.2, seed=9, dtype=None):
    """Add OTT parts to a case: random quant masks (about ``drop`` of the packed slots masked, per
    kv head) in the cache's byte layout, and a ``pool``-slot outlier pool with a few empty slots
    at distinct positions inside the packed range."""
    from kvcalib.runtime.outlier_pool import pack_keep

    g = torch.Generator().manual_seed(seed)
    q, kc = args[0], args[1]
    b, hq, d = q.shape
    h = kc.shape[1] if kc is not None else kw["fp_segments"][0][0].shape[1]
    n = kc.shape[2] if kc is not None else 0
    out = dict(kw)
    if n:
        nblk = -(-n // keep_block)
        keep = torch.rand(b, h, nblk * keep_block, generator=g) >= drop  # (B, H, blocks * G)
        rows = [pack_keep(keep[:, :, i * keep_block:(i + 1) * keep_block]) for i in range(nblk)]
        out.update(keep=torch.cat(rows, dim=2).to(DEVICE), keep_block=keep_block)
    if pool:
        dt = dtype or (kw["fp_segments"][0][0].dtype if kw["fp_segments"] else q.dtype)
        pk = (torch.randn(b, h, pool, d, generator=g) * 3).to(dt).to(DEVICE)  # outliers: large
        pv = torch.randn(b, h, pool, d, generator=g).to(dt).to(DEVICE)
        base = kw.get("packed_position", 0)
        pos = torch.stack([torch.randperm(max(n, pool), generator=g)[:pool] for _ in range(b * h)])
        pos = (pos + base).reshape(b, h, pool).to(torch.int32)  # (B, H, P) distinct positions
        pos[:, :, -2:] = -1  # empty slots
        out["pool"] = (pk, pv, pos.to(DEVICE))
    return args, out


@pytest.mark.parametrize("keep_block,k_axis,k_group,bits", [(16, "channel", 16, 2), (32, "channel", 32, 4),
                                                            (1, "token", 16, 2)],
                         ids=["g16-2b", "g32-4b", "token-keys"])
def test_ott_quant_masks_and_pool(keep_block, k_axis, k_group, bits):
    """OTT inside the kernel: each kv head's masked packed slots are skipped (the quant mask
    bytes as the cache stores them) and the pool joins as a full-precision segment at its own
    positions (empty slots never count)."""
    args, kw = make_case(b=2, n=64, k_axis=k_axis, k_group=k_group, k_bits=bits, v_bits=bits)
    check(*with_ott(args, kw, keep_block=keep_block))


def test_ott_with_padding_mask_and_ragged_range():
    """The pool looks its positions up in the visibility mask (left padding), the quant masks
    combine with the per-batch packed range."""
    args, kw = make_case(b=2, n=48, f=(3, 5))
    args, kw = with_ott(args, kw, keep_block=16)
    total = 3 + 48 + 5
    mask = torch.ones(2, total, dtype=torch.bool)
    mask[1, :15] = False  # batch 1: padding over the sinks and the first packed tokens
    kw["pool"][2][1, :, 0] = 4  # a pool slot of batch 1 at a padding position: hidden
    check(args, {**kw, "mask": mask.to(DEVICE), "packed_start": torch.tensor([0, 12], device=DEVICE)})


def test_ott_pool_only_and_no_fp_segments():
    """Nothing packed (window and pool only), and packed + pool with no sinks or window."""
    args, kw = make_case(n=0, f=(0, 7))
    check(*with_ott(args, kw, keep_block=16))
    args, kw = make_case(n=32, f=())
    check(*with_ott(args, kw, keep_block=16, dtype=torch.bfloat16))


def test_ott_masks_everything_but_the_pool():
    """Every packed slot masked: the result is attention over the pool and window alone."""
    args, kw = make_case(b=1, n=32, f=(0, 4))
    args, kw = with_ott(args, kw, keep_block=16, drop=1.1)
    out = check(args, kw)
    only = da.decode_attention(args[0], *([None] * 6), **{**kw, "keep": None}, config=SMALL)
    assert float((out - only).abs().max()) < 1e-5


def test_ott_arguments_are_checked():
    args, kw = make_case(n=32)
    args, kw = with_ott(args, kw, keep_block=16)
    with pytest.raises(ValueError, match="keep must be uint8"):
        da.decode_attention(*args, **{**kw, "keep": kw["keep"][:, :, :1]})
    with pytest.raises(ValueError, match="keep_block"):
        da.decode_attention(*args, **{**kw, "keep_block": 0})
    pk, pv, pos = kw["pool"]
    with pytest.raises(ValueError, match="pool positions"):
        da.decode_attention(*args, **{**kw, "pool": (pk, pv, pos.long())})


# ---------------------------------------------------------------- SKVQ permutations, TaDA means


def with_perm_mean(args, kw, *, k_perm=False, v_perm=False, k_mean=0, v_mean=0, seed=5):
    """Add random channel permutations (H, D) and per-token means (16-bit float16 or 8-bit codes
    with per-token scale/zero) over the packed tokens of a :func:`make_case` case."""
    g = torch.Generator().manual_seed(seed)
    kc = args[1]
    b, h, n = kc.shape[:3]
    d = args[0].shape[-1]
    extra = {}
    for name, on in (("k_perm", k_perm), ("v_perm", v_perm)):
        if on:
            extra[name] = torch.stack([torch.randperm(d, generator=g) for _ in range(h)]).to(DEVICE)
    for name, bits in (("k_mean", k_mean), ("v_mean", v_mean)):
        mean = torch.randn(b, 1, n, d, generator=g) * 3 + torch.randn(1, 1, 1, d, generator=g) * 2
        if bits == 16:
            extra[name] = mean.half().to(DEVICE)
        elif bits == 8:
            q8 = quantize_values(mean, 8, d)  # (B, 1, N, D) codes, (B, 1, N, 1) scale/zero
            extra[name] = (q8.codes.to(DEVICE), q8.scale.to(DEVICE), q8.zero.to(DEVICE))
    return args, {**kw, **extra}


@pytest.mark.parametrize("k_bits,v_bits,k_mean,v_mean,perm", [
    (2, 2, 16, 16, "kv"), (4, 4, 8, 8, "kv"), (8, 8, 16, 0, "v"), (2, 4, 0, 8, "k"), (4, 2, 0, 0, "kv"),
    (2, 8, 8, 16, ""),
], ids=lambda x: str(x))
def test_permuted_and_centred_layers(k_bits, v_bits, k_mean, v_mean, perm):
    args, kw = make_case(k_bits=k_bits, v_bits=v_bits, v_group=64 if v_bits == 8 else 32, dtype=torch.float16)
    args, kw = with_perm_mean(args, kw, k_perm="k" in perm, v_perm="v" in perm, k_mean=k_mean, v_mean=v_mean)
    out = check(args, kw)
    plain = da.decode_attention(*args, **{k: v for k, v in kw.items() if "perm" not in k and "mean" not in k},
                                config=SMALL)
    assert float((out - plain).abs().max()) > 1e-2  # the permutation / mean really changed the answer


@pytest.mark.parametrize("unpack", [0, 1, 6], ids=lambda u: f"unpack{u}")
def test_permuted_and_centred_unpack_modes_token_keys_and_padding(unpack):
    """Every unpack path (the lane folds too), per-token keys with small value groups (the
    per-element path), a ragged batch with a mask, and a float32 query."""
    cfg = da.DecodeConfig(block_n=16, fp_block=16, unpack=unpack, num_splits=2)
    args, kw = make_case(b=2, n=48, k_bits=4, v_bits=2, f=(3, 5))
    args, kw = with_perm_mean(args, kw, k_perm=True, v_perm=True, k_mean=16, v_mean=8)
    mask = torch.ones(2, 56, dtype=torch.bool)
    mask[1, :19] = False
    check(args, {**kw, "mask": mask.to(DEVICE), "packed_start": torch.tensor([0, 16], device=DEVICE)}, cfg)
    args, kw = make_case(k_axis="token", k_group=16, k_bits=4, v_bits=4, v_group=16, n=40, dtype=torch.float32)
    check(*with_perm_mean(args, kw, k_perm=True, v_perm=True, k_mean=8, v_mean=16), cfg)
    # value-group accumulators (v_group 16 < a 32-byte plane) with a permutation and each mean kind
    for v_perm, v_mean in ((True, 8), (False, 16)):
        args, kw = make_case(b=2, n=48, k_bits=2, v_bits=4, v_group=16, dtype=torch.float16)
        check(*with_perm_mean(args, kw, k_perm=True, v_perm=v_perm, k_mean=16, v_mean=v_mean), cfg)
    args, kw = make_case(d=128, n=48, k_bits=2, v_bits=4, v_group=16, dtype=torch.float16)  # 8 groups: per element
    check(*with_perm_mean(args, kw, v_perm=True, v_mean=8), cfg)


def test_perm_and_mean_shapes_are_checked():
    args, kw = make_case()
    with pytest.raises(ValueError, match="k_perm"):
        da.decode_attention(*args, **kw, k_perm=torch.zeros(3, 64, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="v_mean"):
        da.decode_attention(*args, **kw, v_mean=torch.zeros(2, 1, 48, 64, device=DEVICE))  # float32, not float16
    with pytest.raises(ValueError, match="k_mean: scale"):
        codes = torch.zeros(2, 1, 48, 64, dtype=torch.uint8, device=DEVICE)
        da.decode_attention(*args, **kw, k_mean=(codes, torch.zeros(2, 1, 48, 2, dtype=torch.float16, device=DEVICE),
                                                 torch.zeros(2, 1, 48, 2, dtype=torch.float16, device=DEVICE)))


def test_reference_matches_attend_compressed_on_a_real_layer():
    """The kernel reference and the runtime reference agree (two specifications, one answer)."""
    from kvcalib.layout import LayerConfig

    layer, q, vis = _filled_layer(LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=32, window=16, sinks=2))
    ref = _reference_path(q, layer, vis, 64 ** -0.5)[:, 0]  # (B, Hq, D)
    for i, row in enumerate(layer.rows):  # the padded batch holds one unpadded layer per row
        view = row.packed_view()
        kref = decode_attention_reference(
            q[i:i + 1, :, 0], view.k_codes, view.k_scale, view.k_zero, view.v_codes, view.v_scale, view.v_zero,
            k_bits=2, v_bits=4, k_group=16, v_group=32, scaling=64 ** -0.5, packed_position=view.start,
            fp_segments=[(row.sink_k, row.sink_v), (row.pend_k, row.pend_v)], fp_positions=[0, row.pend_start])
        assert float((ref[i:i + 1] - kref).abs().max()) < 1e-5


# ---------------------------------------------------------------- the runtime adapter


def _row(layer, i: int = 1):
    """What a padded batch's row ``i`` holds (the layer itself when it holds no padding)."""
    return layer.rows[i] if layer.ragged else layer


def _kernel_path(q, layer, vis, scaling):
    """The fused kernel path over ``layer``, a padded batch's rows split where the runtime splits
    them (``backend.decode_attention``): (B, 1, Hq, D), or None where the kernel does not cover it."""
    from kvcalib.runtime.backend import decode_attention

    return decode_attention(q, layer, vis, scaling, path="triton")


def _reference_path(q, layer, vis, scaling):
    """The runtime reference (``attend_compressed``) over ``layer``, its rows split as above."""
    from kvcalib.runtime.backend import decode_attention

    return decode_attention(q, layer, vis, scaling, path="reference")


def _filled_layer(cfg, b=2, h=2, rep=3, d=64, prompt=75, steps=3, pad=(0, 9), dtype=torch.float32, seed=1,
                  codec=None, sliding_window=None):
    """A CompressedLayer after a prompt and a few decode steps; (layer, query (B,Hq,1,D), visible)
    (``visible`` also hides what a ``sliding_window`` no longer shows the last query)."""
    from kvcalib.runtime.cache import CompressedLayer

    g = torch.Generator().manual_seed(seed)
    layer = CompressedLayer(cfg, codec, sliding_window=sliding_window)
    total = prompt + steps + 1
    vis = torch.ones(b, 1, total, dtype=torch.bool)
    for i, p in enumerate(pad):
        vis[i, :, :p] = False
    real = vis[:, 0].clone()  # (B, total): what the window hides below is not padding
    if sliding_window is not None:
        vis[:, :, :total - sliding_window] = False
    for t_new in [prompt] + [1] * (steps + 1):
        k = (torch.randn(b, h, t_new, d, generator=g) * 2).to(dtype).to(DEVICE)
        v = torch.randn(b, h, t_new, d, generator=g).to(dtype).to(DEVICE)
        layer.update(k, v)
        layer.mark_padding(real[:, :layer.n_seen].to(DEVICE))
        if layer.n_seen < total:
            layer.flush()
    q = (torch.randn(b, h * rep, 1, d, generator=g)).to(dtype).to(DEVICE)
    return layer, q, vis.to(DEVICE)


@pytest.mark.parametrize("cfg", [
    dict(k_bits=2, v_bits=2, k_group=16, v_group=32, window=16, sinks=2),
    dict(k_bits=4, v_bits=8, k_group=32, v_group=64, window=32, sinks=0),
    dict(k_bits=4, v_bits=2, k_axis="token", k_group=16, v_group=16, window=0, sinks=3),
    dict(k_bits=3, v_bits=3, k_group=16, v_group=64, window=16, sinks=2),
], ids=["kivi2-sinks", "k4v8-nosinks", "token-keys", "k3v3"])
def test_triton_path_matches_runtime_reference(cfg):
    from kvcalib.layout import LayerConfig

    layer, q, vis = _filled_layer(LayerConfig(**cfg))
    assert layer.n_packed > 0
    out = _kernel_path(q, layer, vis, 64 ** -0.5)
    ref = _reference_path(q, layer, vis, 64 ** -0.5)
    assert out is not None and out.shape == ref.shape == (2, 1, 6, 64)
    assert float((out - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("k_center,v_center,perm", [(16, 8, "kv"), (8, 16, "k"), (0, 16, "v"), (16, 0, "")],
                         ids=["k16-v8-perm-kv", "k8-v16-perm-k", "v16-perm-v", "k16"])
def test_triton_path_runs_centred_and_permuted_layers(k_center, v_center, perm):
    """TaDA means and SKVQ permutations go through the kernel (not the reference) and agree
    with the runtime reference on the same stored bytes."""
    from kvcalib.layout import LayerConfig
    from kvcalib.codec import LayerCodec
    from kvcalib.runtime.triton_path import _reason_unsupported

    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=32, window=16, sinks=2)
    g = torch.Generator().manual_seed(7)
    perms = {s: torch.stack([torch.randperm(64, generator=g) for _ in range(2)]) if s in perm else None
             for s in ("k", "v")}
    codec = LayerCodec(cfg, k_perm=perms["k"], v_perm=perms["v"], k_center=k_center, v_center=v_center)
    layer, q, vis = _filled_layer(cfg, codec=codec)
    assert layer.n_packed > 0 and _reason_unsupported(q, _row(layer)) is None
    view = _row(layer).packed_view()
    assert (view.k_mean is not None) == bool(k_center) and (view.v_mean is not None) == bool(v_center)
    out = _kernel_path(q, layer, vis, 64 ** -0.5)
    ref = _reference_path(q, layer, vis, 64 ** -0.5)
    assert out is not None and float((out - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("cfg", [
    dict(k_bits=2, v_bits=2, k_group=16, v_group=32, window=16, sinks=2),
    dict(k_bits=4, v_bits=2, k_axis="token", k_group=16, v_group=16, window=0, sinks=0),
], ids=["channel-keys-sinks", "token-keys"])
def test_triton_path_runs_ott_layers(cfg):
    """OTT pools go through the kernel (quant masks + pool segment) and agree with the runtime
    reference on the same stored bytes, with left padding; the pools have filled slots."""
    from kvcalib.layout import LayerConfig
    from kvcalib.codec import LayerCodec
    from kvcalib.runtime.triton_path import _reason_unsupported

    lc = LayerConfig(**cfg)
    layer, q, vis = _filled_layer(lc, codec=LayerCodec(lc, outlier_pool=4))
    row = _row(layer)  # the padded row
    assert layer.n_packed > 0 and _reason_unsupported(q, row) is None
    view = row.packed_view()
    assert view.keep is not None and row.outliers.state is not None
    pool_k, _, pool_pos = row.outliers.segment(q.dtype)
    assert int((pool_pos >= 0).sum()) > 0 and pool_pos.dtype == torch.int32
    assert pool_k.data_ptr() == row.outliers.state.pool_k.data_ptr()  # the joined storage: no copy per step
    out = _kernel_path(q, layer, vis, 64 ** -0.5)
    ref = _reference_path(q, layer, vis, 64 ** -0.5)
    assert out is not None and float((out - ref).abs().max()) < 1e-4


def test_log_sum_exp_merges_disjoint_parts():
    """``return_lse`` matches the reference's, and two calls over disjoint parts of one cache
    (packed tokens, then the full-precision segments with a mask and softcap) merge to the
    single call (how a PATS layer is run, one call per tier)."""
    from kvcalib_kernels.reference import merge_parts as merge_partials

    args, kw = make_case(b=2, n=48, f=(3, 5))
    mask = torch.ones(2, 56, dtype=torch.bool)
    mask[1, :20] = False
    kw = {**kw, "mask": mask.to(DEVICE), "softcap": 20.0}
    out, lse = da.decode_attention(*args, **kw, config=SMALL, return_lse=True)
    truth = decode_attention_reference_in(torch.float64, *args, **kw, return_lse=True)[1]
    same = decode_attention_reference_in(args[0].dtype, *args, **kw, return_lse=True)[1]
    assert lse.shape == truth.shape == args[0].shape[:2]
    torch_err = float((same - truth).abs().max())
    assert float((lse - truth).abs().max()) <= 2 * torch_err + ATOL[args[0].dtype]
    assert float((out - decode_attention_reference(*args, **kw)).abs().max()) < 2e-2
    packed_only = da.decode_attention(*args, **{**kw, "fp_segments": (), "fp_positions": ()}, config=SMALL,
                                      return_lse=True)
    fp_only = da.decode_attention(args[0], *([None] * 6), **kw, config=SMALL, return_lse=True)
    assert float((merge_partials([packed_only, fp_only]) - out).abs().max()) < 1e-4
    none = da.decode_attention(args[0], *([None] * 6), **{**kw, "fp_segments": ()}, config=SMALL, return_lse=True)
    assert torch.isinf(none[1]).all() and float((merge_partials([out_lse := (out, lse), none]) - out).abs().max()) == 0
    del out_lse


def _store_parts(bits_of_parts=((8, 8), (4, 4), (2, 2)), sizes=(16, 32, 48), seed=3):
    """Three disjoint packed stores of one cache (PATS tiers: youngest, 8-bit, first) after 3 sinks,
    with a 5-token window; a padding mask over every absolute position and ragged valid ranges."""
    b, h, d = 2, 2, 64
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h * 4, d, generator=g) * 1.5).to(torch.bfloat16).to(DEVICE)
    sinks = tuple((torch.randn(b, h, 3, d, generator=g) * 2).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    window = tuple((torch.randn(b, h, 5, d, generator=g) * 2).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    total = 3 + sum(sizes) + 5
    mask = torch.ones(b, total, dtype=torch.bool)
    mask[1, :30] = False  # left padding of row 1 reaches into the oldest store
    mask = mask.to(DEVICE)
    parts, at = [], 3 + sum(sizes)  # stores sit youngest first, right before the window
    for i, ((kb, vb), n) in enumerate(zip(bits_of_parts, sizes)):
        at -= n
        k = torch.randn(b, h, n, d, generator=g) * 2 + torch.randn(1, 1, 1, d, generator=g)
        v = torch.randn(b, h, n, d, generator=g)
        qk, qv = quantize_keys(k, kb, 16), quantize_values(v, vb, 32)
        part = dict(k_codes=qk.codes.to(DEVICE), k_scale=qk.scale.to(DEVICE), k_zero=qk.zero.to(DEVICE),
                    v_codes=qv.codes.to(DEVICE), v_scale=qv.scale.to(DEVICE), v_zero=qv.zero.to(DEVICE),
                    k_bits=kb, v_bits=vb, k_group=16, v_group=32, scaling=d ** -0.5, packed_position=at,
                    mask=mask, softcap=30.0)
        if i == 0:
            part.update(fp_segments=[sinks, window], fp_positions=[0, 3 + sum(sizes)])
        parts.append(part)
    return q, parts


@pytest.mark.parametrize("channels", [None, 16], ids=lambda c: f"channels{c}")
@pytest.mark.parametrize("s_tot,d", [(1, 16), (5, 64), (64, 32), (65, 64), (300, 128)], ids=str)
def test_combine_matches_a_float64_merge(s_tot, d, channels):
    """The split merge alone (any number of partials: one step, several steps of the running
    max; the launcher's channels per program, or 16) == sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s in
    float64; partials that saw nothing (m = -1e30, l = 0) add nothing; a row where nothing was
    visible is 0 with log-sum-exp -inf."""
    g = torch.Generator().manual_seed(s_tot)
    rows = 3
    m = torch.randn(rows, s_tot, generator=g) * 4  # (ROWS, S) log2 domain
    l = torch.rand(rows, s_tot, generator=g) + 0.5  # (ROWS, S)
    acc = torch.randn(rows, s_tot, d, generator=g)  # (ROWS, S, D)
    m[0, 1::2], l[0, 1::2], acc[0, 1::2] = -1.0e30, 0.0, 0.0  # empty partials
    m[2], l[2], acc[2] = -1.0e30, 0.0, 0.0  # a row with nothing visible
    out = torch.empty(rows, 1, d, device=DEVICE)  # (B=rows, Hq=1, D)
    lse = torch.empty(rows, 1, device=DEVICE)
    combine._combine(m.to(DEVICE), l.to(DEVICE), acc.to(DEVICE), s_tot, out, lse, channels=channels)
    m64, l64, a64 = m.double(), l.double(), acc.double()
    w = torch.exp2(m64 - m64.amax(dim=1, keepdim=True)) * (l64 > 0)  # (ROWS, S)
    den = (w * l64).sum(dim=1)  # (ROWS,)
    want = (w[:, :, None] * a64).sum(dim=1) / den.clamp_min(1e-300)[:, None]  # (ROWS, D)
    got = out[:, 0].double().cpu()
    assert float((got[:2] - want[:2]).abs().max()) < 1e-5 * float(want[:2].abs().max())
    assert not got[2].any()
    want_lse = (m64.amax(dim=1)[:2] + torch.log2(den[:2])) * 0.6931471805599453
    assert float((lse[:2, 0].double().cpu() - want_lse).abs().max()) < 1e-4
    assert torch.isinf(lse[2, 0]) and lse[2, 0] < 0


def test_parts_one_combine_matches_reference():
    """Several disjoint stores at different bits in one buffer of partials with one combine ==
    the reference (each part with its log-sum-exp, merged exactly), under the tolerance rule, and
    == the per-part kernel calls merged in torch; the log-sum-exp is the whole cache's."""
    from kvcalib_kernels.reference import decode_attention_parts_reference, merge_parts

    q, parts = _store_parts()
    out, lse = da.decode_attention_parts(q, parts, config=SMALL, return_lse=True)

    def reference_in(dtype):  # the parts reference, computed in dtype
        return merge_parts([decode_attention_reference_in(dtype, q, **part, return_lse=True) for part in parts])

    truth, same = reference_in(torch.float64), reference_in(q.dtype)
    assert float((decode_attention_parts_reference(q, parts) - reference_in(torch.float32)).abs().max()) == 0
    err, torch_err = float((out - truth).abs().max()), float((same - truth).abs().max())
    assert out.shape == q.shape and err <= 2 * torch_err + ATOL[q.dtype], (err, torch_err)
    singles = [da.decode_attention(q, **part, config=SMALL, return_lse=True) for part in parts]
    assert float((merge_parts(singles) - out).abs().max()) < 1e-4
    whole = torch.logsumexp(torch.stack([part_lse for _, part_lse in singles]), dim=0)  # (B, Hq)
    assert float((lse - whole).abs().max()) < 1e-4
    ref_lse = decode_attention_parts_reference(q, parts, return_lse=True)[1]
    assert float((lse - ref_lse).abs().max()) < 5e-2
    # an empty part (no packed tokens, no fp segments) adds nothing; no parts: zeros, -inf
    empty = dict(k_bits=2, v_bits=2, k_group=16, v_group=32, scaling=0.125)
    assert torch.equal(da.decode_attention_parts(q, parts + [empty], config=SMALL), out)
    none_out, none_lse = da.decode_attention_parts(q, [], config=SMALL, return_lse=True)
    assert not none_out.any() and torch.isinf(none_lse).all()


def test_parts_argument_errors():
    q, parts = _store_parts()
    with pytest.raises(ValueError, match="unknown arguments"):
        da.decode_attention_parts(q, [{**parts[0], "k_bitz": 2}], config=SMALL)
    bad = dict(parts[1])
    del bad["scaling"]
    with pytest.raises(ValueError, match="part 0: missing scaling"):
        da.decode_attention_parts(q, [bad], config=SMALL)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_is_the_float32_result_rounded_once(out_dtype):
    """``out_dtype``: the combine kernel stores the float32 merge rounded to the caller's dtype
    (what a model's attention needs, with no cast kernel after it); bad dtypes are refused."""
    def rounded_once(got, want32):  # == torch's round-to-nearest-even of the float32 result
        want = want32.to(out_dtype)
        if INTERPRET and out_dtype == torch.bfloat16:  # the interpreter's float32 -> bfloat16 truncates
            ulp = (want.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -126)
            return bool(((got.float() - want32).abs() <= ulp).all())
        return torch.equal(got, want)

    q, parts = _store_parts()
    ref32 = da.decode_attention_parts(q, parts, config=SMALL)
    out = da.decode_attention_parts(q, parts, config=SMALL, out_dtype=out_dtype)
    assert out.dtype == out_dtype and rounded_once(out, ref32)
    args, kw = make_case(b=2, n=48, f=(3, 5))
    single = da.decode_attention(*args, **kw, config=SMALL, out_dtype=out_dtype)
    assert rounded_once(single, da.decode_attention(*args, **kw, config=SMALL))
    with pytest.raises(ValueError, match="out_dtype"):
        da.decode_attention_parts(q, parts, config=SMALL, out_dtype=torch.int8)


def _tiered_layer(tiers=(48,), bits=4, ott=0, **kw):
    """A layer whose PATS schedule halves the bits at each age of ``tiers``, after enough steps
    that every stored tier holds blocks."""
    from kvcalib.methods.schedule import Schedule
    from kvcalib.layout import LayerConfig
    from kvcalib.codec import LayerCodec

    cfg = LayerConfig(k_bits=bits, v_bits=bits, k_group=16, v_group=16, window=16, sinks=2)
    codec = LayerCodec(cfg, schedule=Schedule.from_layer(cfg, tiers), outlier_pool=ott)
    return _filled_layer(cfg, codec=codec, prompt=120, **kw)


@pytest.mark.parametrize("tiers,bits,ott", [((48,), 4, 0), ((32, 64), 8, 0), ((48,), 4, 3)],
                         ids=["4-2", "8-4-2", "4-2-ott"])
def test_triton_path_runs_pats_tiers(tiers, bits, ott):
    """A PATS layer runs one kernel call per non-empty tier store (merged by log-sum-exp) and
    agrees with the runtime reference on the same stored bytes, with padding (and OTT pools)."""
    from kvcalib.runtime.triton_path import _reason_unsupported

    layer, q, vis = _tiered_layer(tiers, bits, ott)
    assert _reason_unsupported(q, _row(layer)) is None
    assert sum(1 for st in _row(layer).packed.stores if st.n) == len(tiers) + 1  # every tier holds blocks
    out = _kernel_path(q, layer, vis, 64 ** -0.5)
    ref = _reference_path(q, layer, vis, 64 ** -0.5)
    assert out is not None and float((out - ref).abs().max()) < 1e-4


def test_triton_path_runs_tiered_layers_with_mixed_bits():
    """A PATS layer whose stores hold K8/V4, K4/V4 and K2/V2 blocks (K and V at different bits
    in one store) goes through the kernel with the reference's answer."""
    from kvcalib.methods.schedule import Schedule
    from kvcalib.layout import LayerConfig
    from kvcalib.codec import LayerCodec
    from kvcalib.runtime.triton_path import _reason_unsupported

    cfg = LayerConfig(k_bits=8, v_bits=4, k_group=16, v_group=16, window=16, sinks=2)
    sched = Schedule.from_tensor(torch.tensor([[0, 16, 16], [16, 8, 4], [40, 4, 4], [72, 2, 2]]), sinks=cfg.sinks)
    layer, q, vis = _filled_layer(cfg, codec=LayerCodec(cfg, schedule=sched), prompt=130)
    assert len({(s.bits["k"], s.bits["v"]) for s in _row(layer).packed.stores if s.n}) == 3
    assert _reason_unsupported(q, _row(layer)) is None
    out = _kernel_path(q, layer, vis, 0.125)
    ref = _reference_path(q, layer, vis, 0.125)
    assert out is not None and float((out - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("window,cfg", [
    (40, dict(k_bits=2, v_bits=2, k_group=16, v_group=32, window=16, sinks=2)),
    (12, dict(k_bits=4, v_bits=8, k_group=16, v_group=64, window=16, sinks=0)),
    (34, dict(k_bits=4, v_bits=2, k_axis="token", k_group=16, v_group=16, window=0, sinks=3)),
], ids=["kivi2-sinks", "window-shorter-than-block", "token-keys"])
def test_triton_path_runs_sliding_window_layers(window, cfg):
    """A sliding-window layer (stale packed blocks dropped at its flushes, sinks gone once out of
    the window, the rest hidden by the window's bound in ``visible``; a window shorter than the
    pending full-precision one leaves no packed tokens) through the kernel gives the reference's
    answer, padding included."""
    from kvcalib.layout import LayerConfig
    from kvcalib.runtime.triton_path import _reason_unsupported

    layer, q, vis = _filled_layer(LayerConfig(**cfg), sliding_window=window)
    row = _row(layer, 0)  # the unpadded row (the padded one holds the same, 9 positions later)
    assert layer.is_sliding and _reason_unsupported(q, row) is None
    first_visible = row.n_seen - window  # of the last query (at n_seen - 1)
    held_from = row.packed.start if row.n_packed else row.pend_start  # the oldest token held
    if row.n_packed:  # the flushes dropped every packed block but the one the window's bound cuts
        assert held_from <= first_visible < held_from + row.cfg.flush_block
    else:  # a window shorter than the pending full-precision one: the bound cuts into that
        assert window < row.pend_k.shape[2] and held_from < first_visible
    assert row.sinks_dropped == bool(cfg["sinks"])
    out = _kernel_path(q, layer, vis, 64 ** -0.5)
    ref = _reference_path(q, layer, vis, 64 ** -0.5)
    assert out is not None and float((out - ref).abs().max()) < 1e-4
    if held_from == first_visible:  # nothing stale (token keys flush one token at a time)
        return
    # the window's bound matters: the same query over everything the layer still holds differs
    unbounded = vis.clone()
    unbounded[:, :, :first_visible] = True
    unbounded[1, :, :9] = False  # the second row's padding (_filled_layer)
    assert float((_reference_path(q, layer, unbounded, 64 ** -0.5) - ref).abs().max()) > 1e-2


def test_triton_path_declines_what_it_does_not_cover():
    from kvcalib.layout import LayerConfig
    from kvcalib.runtime.triton_path import triton_decode_attention

    layer, q, vis = _filled_layer(LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=32, window=16))
    q2 = torch.cat([q, q], dim=2)  # two query tokens: not a decode step
    row = _row(layer)  # a padded batch's row: the one unpadded layer the kernel path reads
    assert triton_decode_attention(q2[1:], row, vis[1:, :, -row.n_seen:].expand(-1, 2, -1), 0.1) is None
    raw, q, vis = _filled_layer(LayerConfig(k_bits=16, v_bits=2, k_group=16, v_group=32, window=16))
    assert _kernel_path(q, raw, vis, 0.1) is None  # a 16-bit side


def test_the_kernel_paths_read_one_unpadded_layer():
    """A padded batch's rows are split in one place (``backend.decode_attention``): the kernel path
    and the static kernel path refuse a padded batch's layer (its own tensors hold nothing) rather
    than attend it, and through the split each row is its own launch, the row alone's output."""
    from kvcalib.errors import KvcalibError
    from kvcalib.layout import LayerConfig
    from kvcalib.runtime.triton_path import static_decode_attention, triton_decode_attention

    layer, q, vis = _filled_layer(LayerConfig(k_bits=2, v_bits=2, k_group=16, v_group=32, window=16, sinks=2))
    assert layer.ragged
    with pytest.raises(KvcalibError, match="backend.decode_attention"):
        triton_decode_attention(q, layer, vis, 0.1)
    with pytest.raises(KvcalibError, match="backend.decode_attention"):
        static_decode_attention(q, layer, 0.1)
    out = _kernel_path(q, layer, vis, 0.1)
    for i, row in enumerate(layer.rows):
        assert torch.equal(out[i:i + 1], triton_decode_attention(q[i:i + 1], row, vis[i:i + 1, :, -row.n_seen:], 0.1))


@pytest.mark.parametrize("fitted", [False, True, "ott", "pats", "sliding"],
                         ids=["plain", "centred-permuted", "ott", "pats", "gemma3-sliding"])
def test_generate_through_the_kernel_matches_the_reference_backend(monkeypatch, fitted):
    """A tiny model decodes through the kernel (counted) with the reference backend's logits;
    ``fitted``: every layer also has TaDA means (16-bit keys, 8-bit values) and SKVQ permutations;
    ``ott``: every layer has a 4-slot OTT outlier pool; ``pats``: 4-bit blocks become 2-bit at age 28;
    ``sliding``: a Gemma 3 model, its first layer a 28-token sliding window (blocks dropped, sinks
    gone, the window's bound from transformers' mask), its second global."""
    from kvcalib.layout import LayerConfig
    from kvcalib.recipe import Recipe
    from kvcalib.runtime import triton_path
    from kvcalib.runtime.attention import use_kvcalib_attention
    from kvcalib.runtime.cache import CompressedCache
    from kvcalib.codec import LayerCodec
    from tests.conftest import tiny_model

    if fitted == "sliding":
        model = tiny_model("gemma3", head_dim=64, heads=4, kv_heads=2, sliding_window=28).to(DEVICE)
    else:
        model = tiny_model("llama", head_dim=64, heads=4, kv_heads=2).to(DEVICE)
    rec = Recipe(name="t", default_layer=LayerConfig(k_bits=2, v_bits=4, k_group=16, v_group=32, window=16, sinks=2))
    # pats: the last steps hold a 4-bit and a 2-bit block; sliding: the first block is dropped
    length = 52 if fitted in ("pats", "sliding") else 44
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    calls = []
    real, real_static = triton_path.triton_decode_attention, triton_path.static_decode_attention

    def counted(*a, **k):
        out = real(*a, **k)
        if a[0].shape[2] == 1:  # decode steps (the prompt goes to the reference)
            calls.append(out is not None)
        return out

    def counted_static(*a, **k):  # on CUDA, layer graphs capture the kernel through the static launch
        out = real_static(*a, **k)
        calls.append(out is not None)
        return out

    def run(backend):
        monkeypatch.setenv("KVCALIB_BACKEND", backend)
        if fitted == "ott":
            cfgs = rec.layer_configs(model.config.num_hidden_layers)
            cache = CompressedCache(cfgs, [LayerCodec(c, outlier_pool=4) for c in cfgs])
            use_kvcalib_attention(model)
        elif fitted == "pats":
            from kvcalib.methods.schedule import Schedule

            cfg4 = LayerConfig(k_bits=4, v_bits=4, k_group=16, v_group=32, window=16, sinks=2)
            cfgs = [cfg4] * model.config.num_hidden_layers
            cache = CompressedCache(cfgs, [LayerCodec(c, schedule=Schedule.from_layer(c, (28,))) for c in cfgs])
            use_kvcalib_attention(model)
        elif fitted is True:
            g = torch.Generator().manual_seed(4)
            cfgs = rec.layer_configs(model.config.num_hidden_layers)
            perm = [torch.stack([torch.randperm(64, generator=g) for _ in range(2)]) for _ in range(2 * len(cfgs))]
            cache = CompressedCache(cfgs, [LayerCodec(c, k_perm=perm[2 * i], v_perm=perm[2 * i + 1], k_center=16,
                                                      v_center=8) for i, c in enumerate(cfgs)])
            use_kvcalib_attention(model)
        else:
            cache = CompressedCache.from_recipe(model, rec)
        outs = []
        with torch.no_grad():
            outs.append(model(input_ids=ids[:, :34], past_key_values=cache).logits[:, -1].float())
            for i in range(34, ids.shape[1]):
                outs.append(model(input_ids=ids[:, i:i + 1], past_key_values=cache).logits[:, -1].float())
        if fitted == "pats":  # the last steps read two tier stores (4-bit and 2-bit blocks)
            assert all(sum(1 for st in layer.packed.stores if st.n) == 2 for layer in cache.layers)
        if fitted == "sliding":  # the sliding layer dropped its sinks and old blocks, the global one did not
            sliding, full = cache.layers
            assert sliding.is_sliding and sliding.sinks_dropped and sliding.packed.start > 2
            assert not full.is_sliding and full.packed.start == 2
        return torch.stack(outs)

    ref = run("reference")
    monkeypatch.setattr(triton_path, "triton_decode_attention", counted)
    monkeypatch.setattr(triton_path, "static_decode_attention", counted_static)
    fused = run("triton")
    assert calls and all(calls)  # every decode step of every layer went through the kernel (eager or captured)
    assert float((fused - ref).abs().max()) < 1e-3 * max(1.0, float(ref.abs().max()))


# ---------------------------------------------------------------- full-size grid (GPU)


GPU_GRID_LAYOUTS = [
    (2, 2, 128, 128), (4, 4, 128, 128), (4, 4, 32, 32), (8, 8, 64, 64), (2, 4, 32, 128), (8, 2, 128, 32),
    (3, 3, 128, 128), (3, 3, 64, 64), (3, 4, 32, 32), (8, 3, 64, 32),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("d,rep,dtype", [
    (64, 3, torch.bfloat16), (128, 1, torch.bfloat16), (128, 4, torch.bfloat16), (128, 7, torch.bfloat16),
    (256, 4, torch.bfloat16), (128, 4, torch.float16),
], ids=lambda x: str(x))
@pytest.mark.parametrize("k_bits,v_bits,k_group,v_group", GPU_GRID_LAYOUTS,
                         ids=["k{}v{}-g{}-{}".format(*x) for x in GPU_GRID_LAYOUTS])
def test_gpu_grid(d, rep, dtype, k_bits, v_bits, k_group, v_group):
    if d % v_group or d * plan.plane_bits(min(k_bits, v_bits)) // 8 < 16:
        pytest.skip("layout not valid for this head_dim")
    n = 4 * k_group * 9  # several splits
    args, kw = make_case(b=3, h=2, rep=rep, d=d, n=n, f=(4, 131), k_bits=k_bits, v_bits=v_bits,
                         k_group=k_group, v_group=v_group, dtype=dtype, seed=d + rep)
    end = torch.tensor([n, n - 77, 1], device=DEVICE)
    start = torch.tensor([0, 130, 0], device=DEVICE)
    kw = {**kw, "packed_start": start, "packed_end": end}
    for unpack in (1, 2, 5, 6):
        check(args, kw, da.DecodeConfig(unpack=unpack))
    check(args, kw, da.DecodeConfig(unpack=5, num_warps=2))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_n,num_warps,num_stages,unpack", [
    (64, 1, 1, 2), (32, 1, 2, 2), (64, 2, 1, 2), (128, 4, 2, 2), (64, 1, 1, 1), (64, 1, 1, 0),
    (64, 1, 2, 5), (64, 2, 2, 5), (128, 4, 2, 5), (64, 4, 2, 5), (32, 1, 2, 5), (64, 1, 3, 6),
], ids=str)
@pytest.mark.parametrize("bits", [2, 3, 4, 8], ids=lambda b: f"{b}b")
def test_gpu_configs(block_n, num_warps, num_stages, unpack, bits):
    args, kw = make_case(b=4, h=8, rep=4, d=128, n=128 * 40, f=(0, 128), dtype=torch.bfloat16,
                         k_bits=bits, v_bits=bits, k_group=128, v_group=128, spare=256)
    check(args, kw, da.DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=num_stages, unpack=unpack))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["bytes", "lanes"])
def test_gpu_fast_unpack_probe(kind):
    assert da.fast_unpack_available(0, kind), f"inline-PTX unpack ({kind}): {plan.FAST_UNPACK_ERROR.get(kind)}"
