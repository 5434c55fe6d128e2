"""Triton Huffman decoder and Huffman-fused decode attention vs their PyTorch references.

Runs on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set here before any kernel
module is imported) at small shapes, and on CUDA as is; the full-size grid is marked ``gpu``.

Tolerances (STYLE habit 2): the decoder is bit-exact (``torch.equal`` with
:func:`kvcalib.quant.huffman.decode_blocks` and with the symbols that were encoded); the fused
attention follows flash-attn's rule ``|kernel - truth| <= 2 * |torch_same_dtype - truth| +
atol(dtype)``, truth = the reference in float64 on the decoded codes.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

# the interpreter must be chosen before a @triton.jit function is defined (modules in dependency order)
DEVICE, INTERPRET, (da, hd, dah) = kernel_modules("kvcalib_kernels.decode_attention", "kvcalib_kernels.huffman_decode",
                                                  "kvcalib_kernels.decode_attention_huffman")
from kvcalib.quant.huffman import (Codebook, EncodedBlocks, HuffmanError, build_codebook,  # noqa: E402
                                   decode_blocks, encode_blocks, symbol_histogram)
from kvcalib.quant.packing import pack_codes, unpack_codes  # noqa: E402
from kvcalib.quant.uniform import quantize_keys, quantize_values  # noqa: E402
from kvcalib_kernels.reference import (decode_attention_huffman_reference,  # noqa: E402
                                       decode_attention_reference_in, huffman_decode_reference)

requires_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run through the device tool)")
ATOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}
SMALL = dah.HuffmanAttentionConfig(block_n=32, fp_block=16)


def _skewed(n: int, L: int, bits: int, seed: int, temp: float = 2.0) -> torch.Tensor:
    """uint8 (n, L) symbols from a random skewed distribution over 2**bits symbols."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(1 << bits, generator=g) * temp, 0)
    return torch.multinomial(probs, n * L, replacement=True, generator=g).to(torch.uint8).reshape(n, L)


def _to(enc: EncodedBlocks, device) -> EncodedBlocks:
    return EncodedBlocks(enc.payload.to(device), enc.bit_offsets.to(device), enc.raw_fallback.to(device),
                         enc.n_symbols, enc.bits)


def check_decode(x: torch.Tensor, cb: Codebook) -> EncodedBlocks:
    enc = encode_blocks(x, cb)
    out = hd.huffman_decode(_to(enc, DEVICE), cb)
    assert out.dtype == torch.uint8 and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out.cpu(), huffman_decode_reference(enc, cb))
    assert torch.equal(out.cpu(), x)
    return enc


# ---------------------------------------------------------------- decoder (CPU interpreter)


@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
@pytest.mark.parametrize("L", [1, 7, 37, 128], ids=lambda n: f"L{n}")
def test_decode_round_trip(bits, L):
    """Streams of several lengths (tails of the 16-symbol store tile), calibration != data."""
    x = _skewed(150, L, bits, seed=bits * 1000 + L)
    cb = build_codebook(symbol_histogram(_skewed(150, L, bits, seed=bits * 1000 + L + 1), bits))
    check_decode(x, cb)


@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
def test_decode_raw_fallback_mixed_with_coded_streams(bits):
    """Uniform rows cost more than raw under a skewed code (escape to raw); skewed rows are coded."""
    skew = _skewed(40, 64, bits, seed=bits, temp=3.0)
    g = torch.Generator().manual_seed(bits + 7)
    uniform = torch.randint(0, 1 << bits, (40, 64), generator=g, dtype=torch.uint8)
    x = torch.stack([skew, uniform], 1).reshape(80, 64)  # interleaved coded / raw streams
    enc = check_decode(x, build_codebook(symbol_histogram(skew, bits)))
    assert 0 < int(enc.raw_fallback.sum()) < 80


@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
def test_decode_symbols_unseen_by_the_codebook(bits):
    """Calibration saw only symbol 0 or 1: every other symbol has a longest (pseudo-count) code."""
    h = torch.zeros(1 << bits, dtype=torch.int64)
    h[0], h[1] = 10_000, 10
    cb = build_codebook(h)
    g = torch.Generator().manual_seed(bits)
    rare = torch.randint(0, 1 << bits, (30, 24), generator=g, dtype=torch.uint8)
    mostly = torch.where(torch.rand(30, 24, generator=g) < 0.9, 0, rare).to(torch.uint8)
    check_decode(torch.cat([rare, mostly]), cb)


def test_decode_longest_code_words_use_the_full_table():
    """8-bit codebook whose longest word is max_len (12): a 4096-entry table, 12-bit peeks."""
    h = (2.0 ** -torch.arange(256).clamp(max=40).double() * 1e12).to(torch.int64) + 1
    cb = build_codebook(h)
    assert int(cb.lengths.max()) == 12
    x = torch.cat([_skewed(20, 50, 8, seed=3), torch.full((4, 50), 255, dtype=torch.uint8)])
    check_decode(x, cb)


def test_decode_empty_blocks():
    cb = build_codebook(torch.tensor([5, 3, 1, 1]))
    assert hd.huffman_decode(_to(encode_blocks(torch.zeros((0, 9), dtype=torch.uint8), cb), DEVICE), cb).shape == (0, 9)
    assert hd.huffman_decode(_to(encode_blocks(torch.zeros((3, 0), dtype=torch.uint8), cb), DEVICE), cb).shape == (3, 0)


def _parts(x, cb):
    enc = encode_blocks(x, cb)
    return enc.payload.clone(), enc.bit_offsets.clone(), enc.raw_fallback.clone(), enc.n_symbols


def test_corrupt_offsets_are_refused_before_the_kernel():
    cb = build_codebook(symbol_histogram(_skewed(20, 30, 4, seed=1), 4))
    payload, off, raw, L = _parts(_skewed(20, 30, 4, seed=2), cb)
    table = hd.decode_table(cb, DEVICE)

    def run(p=payload, o=off, r=raw, **kw):
        return hd.decode_streams(p.to(DEVICE), o.to(DEVICE), r.to(DEVICE), table, n_symbols=L, **kw)

    dec = off.clone()
    dec[5], dec[6] = off[6], off[5]
    with pytest.raises(ValueError, match="decrease"):
        run(o=dec)
    past = off.clone()
    past[-1] = 32 * payload.numel() + 100
    with pytest.raises(ValueError, match="past its end|payload"):
        run(o=past)
    with pytest.raises(ValueError, match="payload"):
        run(p=payload[:-2])  # truncated payload
    shifted = off + 3
    with pytest.raises(ValueError, match=r"bit_offsets\[0\]"):
        run(o=shifted)
    flipped = raw.clone()
    flipped[0] = ~flipped[0]
    with pytest.raises(ValueError, match="raw|coded"):
        run(r=flipped)
    with pytest.raises(ValueError, match="N\\+1"):
        run(o=off[:-1])
    with pytest.raises(ValueError, match="int64"):
        run(o=off.to(torch.int32))
    # without validation corrupt offsets stay memory-safe (masked loads, fixed trip count)
    wild = torch.full_like(off, 1 << 40)
    wild[0] = -(1 << 40)
    assert run(o=wild, validate=False).shape == (20, 30)


def test_streams_that_do_not_end_at_their_offsets_are_refused_like_the_reference():
    """A different codebook (or a corrupt payload) leaves streams misaligned: both decoders raise."""
    x = _skewed(25, 40, 4, seed=5)
    cb = build_codebook(symbol_histogram(x, 4))
    enc = encode_blocks(x, cb)
    other = Codebook.from_lengths(torch.full((16,), 4))  # every word 4 bits: overruns the coded streams
    with pytest.raises(HuffmanError):
        decode_blocks(enc, other)
    with pytest.raises(HuffmanError, match="does not decode"):
        hd.huffman_decode(_to(enc, DEVICE), other)
    with pytest.raises(HuffmanError, match="bit"):
        hd.huffman_decode(_to(enc, DEVICE), build_codebook(symbol_histogram(_skewed(5, 5, 2, seed=0), 2)))


# ---------------------------------------------------------------- fused attention (CPU interpreter)


def make_case(*, b=1, h=2, rep=3, d=64, n=64, f=(2, 5), k_bits=2, v_bits=4, k_group=32, v_group=32,
              dtype=torch.float16, seed=0, laplace=True):
    """Quantized K/V (reference quantizer on Laplace data: naturally skewed codes), coded per token
    with codebooks fitted on *another* draw, plus fp segments.

    Returns (args, kwargs) for decode_attention_huffman(_reference) and the packed codes."""
    g = torch.Generator().manual_seed(seed)

    def draw(shape):
        if laplace:
            u = (torch.rand(shape, generator=g) - 0.5).clamp(-0.4999, 0.4999)  # -0.5 would give -inf
            return -u.sign() * torch.log1p(-2 * u.abs())  # Laplace(0, 1)
        return torch.randn(shape, generator=g)

    k = draw((b, h, n, d)) * 2 + torch.randn(1, 1, 1, d, generator=g)
    v = draw((b, h, n, d))
    qk, qv = quantize_keys(k, k_bits, k_group), quantize_values(v, v_bits, v_group)
    ksym = unpack_codes(qk.codes, k_bits).reshape(-1, d)  # (B*H*N, D): one stream per token
    vsym = unpack_codes(qv.codes, v_bits).reshape(-1, d)
    calib_k = unpack_codes(quantize_keys(draw((1, h, 2 * k_group, d)) * 2, k_bits, k_group).codes, k_bits)
    calib_v = unpack_codes(quantize_values(draw((1, h, 32, d)), v_bits, v_group).codes, v_bits)
    kcb = build_codebook(symbol_histogram(calib_k, k_bits))
    vcb = build_codebook(symbol_histogram(calib_v, v_bits))
    kblk = _to(encode_blocks(ksym, kcb), DEVICE)
    vblk = _to(encode_blocks(vsym, vcb), DEVICE)
    q = (torch.randn(b, h * rep, d, generator=g) * 1.5).to(dtype).to(DEVICE)
    segs, pos = [], []
    for i, fl in enumerate(f):
        if fl == 0:
            continue
        segs.append(((torch.randn(b, h, fl, d, generator=g) * 2).to(dtype).to(DEVICE),
                     torch.randn(b, h, fl, d, generator=g).to(dtype).to(DEVICE)))
        pos.append(0 if i == 0 else f[0] + n)
    kw = dict(k_codebook=kcb, v_codebook=vcb, k_group=k_group, v_group=v_group, scaling=d ** -0.5,
              fp_segments=segs, fp_positions=pos, packed_position=f[0])
    args = (q, kblk, qk.scale.to(DEVICE), qk.zero.to(DEVICE), vblk, qv.scale.to(DEVICE), qv.zero.to(DEVICE))
    return args, kw, (qk.codes.to(DEVICE), qv.codes.to(DEVICE))


def _decoded_codes(args, kw):
    """Packed codes of the reference decoder (decode_blocks, then pack_codes): (k_codes, v_codes)."""
    q, kblk, ks, kz, vblk, vs, vz = args
    b, h, n = vs.shape[:3]
    d = q.shape[2]
    kc = pack_codes(decode_blocks(_to(kblk, "cpu"), kw["k_codebook"]).reshape(b, h, n, d), kw["k_codebook"].bits)
    vc = pack_codes(decode_blocks(_to(vblk, "cpu"), kw["v_codebook"]).reshape(b, h, n, d), kw["v_codebook"].bits)
    return kc.to(q.device), vc.to(q.device)


def _ref_in(dtype, args, kw, codes=None):
    """decode_attention_reference_in on the decoded (then packed) codes."""
    q, kblk, ks, kz, vblk, vs, vz = args
    kc, vc = codes if codes is not None else _decoded_codes(args, kw)
    rest = {k: v for k, v in kw.items() if k not in ("k_codebook", "v_codebook")}
    return decode_attention_reference_in(dtype, q, kc, ks, kz, vc, vs, vz,
                                         k_bits=kw["k_codebook"].bits, v_bits=kw["v_codebook"].bits, **rest)


def check(args, kw, configs=(SMALL,), packed=None, twin=True):
    """Every config against the float64 truth (tolerance rule); with ``packed`` (the quantizer's
    codes) also the unfused path; with ``twin`` the named reference too. References are computed
    once per case (the reference decoder is NumPy on the CPU)."""
    if isinstance(configs, dah.HuffmanAttentionConfig):
        configs = (configs,)
    q = args[0]
    codes = _decoded_codes(args, kw)
    if packed is not None:
        assert torch.equal(codes[0], packed[0]) and torch.equal(codes[1], packed[1])
    truth = _ref_in(torch.float64, args, kw, codes)
    same = _ref_in(q.dtype, args, kw, codes)
    torch_err = float((same - truth).abs().max())
    if twin:  # the named twin: the same function in float32
        ref = decode_attention_huffman_reference(*args, **kw)
        assert float((ref - _ref_in(torch.float32, args, kw, codes)).abs().max()) == 0.0
    fixed = None
    if packed is not None:
        # the unfused path: Triton decoder -> packed codes -> fixed-width kernel, on the same values
        q_, kblk, ks, kz, vblk, vs, vz = args
        b, h, n = vs.shape[:3]
        d = q_.shape[2]
        kc = pack_codes(hd.huffman_decode(kblk, kw["k_codebook"]).reshape(b, h, n, d), kw["k_codebook"].bits)
        vc = pack_codes(hd.huffman_decode(vblk, kw["v_codebook"]).reshape(b, h, n, d), kw["v_codebook"].bits)
        assert torch.equal(kc, packed[0]) and torch.equal(vc, packed[1])
        rest = {k: v for k, v in kw.items() if k not in ("k_codebook", "v_codebook")}
        fixed = da.decode_attention(q_, kc, ks, kz, vc, vs, vz, k_bits=kw["k_codebook"].bits,
                                    v_bits=kw["v_codebook"].bits, **rest,
                                    config=da.DecodeConfig(block_n=16, fp_block=16))
    for config in configs:
        out = dah.decode_attention_huffman(*args, **kw, config=config)
        err = float((out - truth).abs().max())
        assert out.dtype == torch.float32 and out.shape == q.shape
        assert torch.isfinite(out).all()
        assert err <= 2 * torch_err + ATOL[q.dtype], \
            f"{config}: kernel error {err:.3g} vs torch {q.dtype} error {torch_err:.3g}"
        if fixed is not None:
            diff = float((out - fixed).abs().max())
            assert diff <= 2 * torch_err + ATOL[q.dtype], f"fused vs unfused {diff:.3g} (torch error {torch_err:.3g})"
    return out


@pytest.mark.parametrize("k_bits,v_bits", [(2, 2), (4, 4), (2, 4), (4, 2), (8, 4)], ids=lambda x: f"{x}b")
def test_fused_bits_against_reference_and_unfused_path(k_bits, v_bits):
    args, kw, packed = make_case(k_bits=k_bits, v_bits=v_bits, n=32, seed=k_bits)
    check(args, kw, packed=packed)


@pytest.mark.parametrize("rep", [1, 3, 4, 7], ids=lambda r: f"gqa{r}")
def test_fused_gqa_ratios_head_dim_128(rep):
    args, kw, _ = make_case(rep=rep, d=128, h=1, n=32, k_bits=2, v_bits=4, v_group=128, seed=rep)
    check(args, kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_query_dtypes(dtype):
    args, kw, _ = make_case(dtype=dtype, k_bits=4, v_bits=2, n=32)
    check(args, kw)


def test_fused_ragged_ranges_off_the_block_grid_and_split_mid_group():
    """Per-batch packed ranges [start, end) not on the 32-token block grid, a one-token row, and
    splits that start inside a 96-token key group."""
    args, kw, _ = make_case(b=3, h=1, rep=4, n=192, k_group=96, k_bits=4, v_bits=2, seed=11)
    start = torch.tensor([0, 5, 37], device=DEVICE)
    end = torch.tensor([192, 71, 38], device=DEVICE)  # 192, 66 and 1 valid packed tokens
    check(args, {**kw, "packed_start": start, "packed_end": end},
          dah.HuffmanAttentionConfig(block_n=32, fp_block=16, num_splits=3))


def test_fused_one_packed_token_visible_and_small_value_groups():
    """Only one packed token is visible (mask), value groups of 16 channels (per-element path)."""
    args, kw, packed = make_case(b=1, h=1, rep=2, n=32, v_group=16, k_bits=2, v_bits=2, f=(0, 3), seed=4)
    mask = torch.zeros(1, 35, dtype=torch.bool)
    mask[0, 9] = True  # packed token 9
    mask[0, 33] = True  # one window token
    check(args, {**kw, "mask": mask.to(DEVICE)}, packed=packed)


def test_fused_softcap_sinks_window_and_padding_mask():
    args, kw, _ = make_case(b=2, h=1, rep=3, n=32, f=(3, 6), seed=6)
    mask = torch.ones(2, 41, dtype=torch.bool)
    mask[1, :20] = False  # left padding over the sinks and part of the packed tokens
    mask[0, 10] = False
    check(args, {**kw, "mask": mask.to(DEVICE), "softcap": 5.0})


def test_fused_window_only_and_gaussian_codes():
    args, kw, _ = make_case(n=32, laplace=False, seed=8)
    check(args, kw)
    q = args[0]
    out = dah.decode_attention_huffman(q, None, None, None, None, None, None, **kw, config=SMALL)
    ref = decode_attention_reference_in(torch.float64, q, None, None, None, None, None, None, k_bits=2, v_bits=2,
                                        **{k: v for k, v in kw.items() if k not in ("k_codebook", "v_codebook")})
    assert float((out - ref).abs().max()) < 5e-3


def test_fused_refuses_what_it_does_not_support():
    args, kw, _ = make_case(n=32)
    q, kblk, ks, kz, vblk, vs, vz = args
    run = dah.decode_attention_huffman
    with pytest.raises(ValueError, match="k_axis"):
        run(*args, **{**kw, "k_axis": "token"})
    with pytest.raises(ValueError, match="k_group"):
        run(*args, **{**kw, "k_group": 12})
    with pytest.raises(ValueError, match="k_group"):
        run(*args, **{**kw, "k_group": 16})  # a 16-token block would leave threads without a stream
    with pytest.raises(ValueError, match="v_group"):
        run(*args, **{**kw, "v_group": 4})
    with pytest.raises(ValueError, match="v_group"):
        run(*args, **{**kw, "v_group": 24})
    three = build_codebook(torch.ones(8, dtype=torch.int64))  # a 3-bit code
    with pytest.raises(ValueError, match="bits"):
        run(*args, **{**kw, "k_codebook": three})
    short = EncodedBlocks(kblk.payload, kblk.bit_offsets[:-32], kblk.raw_fallback[:-32], kblk.n_symbols, kblk.bits)
    with pytest.raises(ValueError, match="streams"):
        run(q, short, ks, kz, vblk, vs, vz, **kw)
    with pytest.raises(ValueError, match="scale"):
        run(q, kblk, ks.float(), kz, vblk, vs, vz, **kw)
    assert dah.supports(head_dim=256, k_bits=2, v_bits=2, k_group=128, v_group=128) is not None
    assert dah.supports(head_dim=128, k_bits=4, v_bits=2, k_group=128, v_group=128) is None


def test_fused_refuses_corrupt_offsets():
    args, kw, _ = make_case(n=32)
    q, kblk, ks, kz, vblk, vs, vz = args
    off = kblk.bit_offsets.clone()
    off[3], off[4] = off[4].item(), off[3].item()  # decreasing: EncodedBlocks itself would refuse it
    corrupt = object.__new__(EncodedBlocks)  # bypass its construction checks, as a buggy producer could
    for name, val in (("payload", kblk.payload), ("bit_offsets", off), ("raw_fallback", kblk.raw_fallback),
                      ("n_symbols", kblk.n_symbols), ("bits", kblk.bits)):
        object.__setattr__(corrupt, name, val)
    with pytest.raises(ValueError, match="decrease"):
        dah.decode_attention_huffman(q, corrupt, ks, kz, vblk, vs, vz, **kw)
    past = object.__new__(EncodedBlocks)
    for name, val in (("payload", vblk.payload[:3]), ("bit_offsets", vblk.bit_offsets),
                      ("raw_fallback", vblk.raw_fallback), ("n_symbols", vblk.n_symbols), ("bits", vblk.bits)):
        object.__setattr__(past, name, val)
    with pytest.raises(ValueError, match="payload"):
        dah.decode_attention_huffman(q, kblk, ks, kz, past, vs, vz, **kw)
    # validate=False: never an out-of-bounds read or a hang, just a finite (wrong) answer
    out = dah.decode_attention_huffman(q, kblk, ks, kz, past, vs, vz, **kw, validate=False, config=SMALL)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- full-size grid (GPU)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"{b}b")
def test_gpu_decode_many_streams(bits):
    x = _skewed(200_003, 128, bits, seed=bits)
    cb = build_codebook(symbol_histogram(_skewed(1000, 128, bits, seed=bits + 1), bits))
    enc = encode_blocks(x, cb)
    out = hd.huffman_decode(_to(enc, DEVICE), cb)
    assert torch.equal(out.cpu(), x)
    for chunk, block_s, warps in ((8, 64, 2), (32, 256, 8)):
        table = hd.decode_table(cb, DEVICE)
        e = _to(enc, DEVICE)
        out = hd.decode_streams(e.payload, e.bit_offsets, e.raw_fallback, table, n_symbols=128, chunk=chunk,
                                block_s=block_s, num_warps=warps)
        assert torch.equal(out.cpu(), x)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("d,rep,dtype,k_bits,v_bits,k_group,v_group,two_configs", [
    (128, 4, torch.bfloat16, 2, 2, 128, 128, True),  # the Mistral layout
    (128, 4, torch.bfloat16, 4, 4, 128, 128, True),
    (128, 7, torch.float16, 2, 4, 32, 128, False),
    (128, 1, torch.bfloat16, 4, 2, 128, 16, False),  # two value groups per 32-channel chunk
    (128, 4, torch.float32, 2, 2, 128, 128, False),  # IEEE float32 products
    (64, 3, torch.bfloat16, 4, 4, 32, 32, False),
    (64, 3, torch.float16, 2, 2, 64, 64, False),
], ids=lambda x: str(x))
def test_gpu_grid(d, rep, dtype, k_bits, v_bits, k_group, v_group, two_configs):
    """Full-size grid: several splits and key groups, ragged ranges, sinks + window, raw streams.
    (Each case compiles its own kernels: keep the list short, the tests stage has a time limit.)"""
    n = 3 * k_group * 4
    args, kw, packed = make_case(b=3, h=2, rep=rep, d=d, n=n, f=(4, 131), k_bits=k_bits, v_bits=v_bits,
                                 k_group=k_group, v_group=v_group, dtype=dtype, seed=d + rep)
    end = torch.tensor([n, n - 77, 1], device=DEVICE)
    start = torch.tensor([0, 130, 0], device=DEVICE)
    kw = {**kw, "packed_start": start, "packed_end": end}
    configs = [dah.HuffmanAttentionConfig()]
    if two_configs:
        configs.append(dah.HuffmanAttentionConfig(block_n=32, num_warps=1, max_index_bits=0))
    check(args, kw, configs, packed=packed, twin=False)
