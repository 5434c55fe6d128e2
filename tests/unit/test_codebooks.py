"""Huffman codebooks of a recipe, the cache stream layout, coded memory, and the measurement.

Round trips are bit-exact (``torch.equal``); corrupt codebooks raise RecipeError naming the tensor;
corrupt streams raise HuffmanError, never a wrong answer or a hang.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcalib.methods.base import CalibrationError, reservoir_to_bhtd
from kvcalib.methods.huffman import (HUFFMAN, HUFFMAN_HIST, CacheStreams, StreamLayout, add_codebooks,
                                         codebook_bits, decode_cache_streams, decode_side, encode_cache_streams,
                                         encode_side, entropy_memory, flush_codes, implied_bits, layer_histograms,
                                         load_codebooks, side_coded_bytes, strip_codebooks, tensor_name,
                                         to_cache_streams)
from kvcalib.errors import RecipeError
from kvcalib.models import model_info
from kvcalib.quant.huffman import HuffmanError, build_codebook, symbol_histogram
from kvcalib.quant.packing import unpack_codes
from kvcalib.layout import LayerConfig, quantized_token_count
from kvcalib.recipe import Recipe
from kvcalib.recipe import build_codecs
from kvcalib.stats import CollectedStats, LayerStats
from tests.conftest import tiny_config

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

H, D = 2, 16
CONFIGS = [  # layer 0: K per channel (flush 8), V 4-bit; layer 1: K kept at 16 bits, V 2-bit (flush 1)
    LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=8, window=8),
    LayerConfig(k_bits=16, v_bits=2, v_group=8, window=0, sinks=2),
]


def _info():
    return model_info(tiny_config("llama", layers=2, heads=4, kv_heads=H, head_dim=D), "tiny")


def _stats(nb: int = 3, bl: int = 28, seed: int = 0) -> CollectedStats:
    """Reservoir of Laplacian-ish tokens with an outlier channel (bl=28: not a multiple of 8)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(2):
        def res() -> torch.Tensor:
            x = torch.distributions.Laplace(0.0, 1.0).sample((nb, bl, H, D))
            x[..., 3] *= 8  # an outlier channel
            return (x + 0.1 * torch.randn(nb, bl, H, D, generator=g)).to(torch.float16)
        zero = torch.zeros(H, D)
        group = {"count": torch.tensor(nb * bl), "min": zero, "max": zero, "mean": zero, "absmax": zero,
                 "sq_mean": zero}
        layers.append(LayerStats(k=dict(group), v=dict(group), reservoir_k=res(), reservoir_v=res(),
                                 reservoir_q=torch.zeros(nb, bl, 4, D, dtype=torch.float16), scaling=D ** -0.5))
    return CollectedStats(model=_info(), layers=layers, filled_blocks=nb)


def _recipe() -> Recipe:
    g = torch.Generator().manual_seed(1)
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(H)])  # (H, D)
    return Recipe(name="r", layers=list(CONFIGS), model=_info(), tensors={
        "layers.0.v.perm": perm, "layers.0.k.clip": torch.full((H, 1), 0.9),
        "layers.1.v.center": torch.tensor(16.0)}, provenance={"made_by": "test"})


@pytest.fixture(scope="module")
def stats():
    torch.manual_seed(0)
    return _stats()


@pytest.fixture(scope="module")
def coded(stats):
    return add_codebooks(_recipe(), stats, only_if_smaller=False)


# ----------------------------------------------------------------------------------------------
# histograms and codebooks


def test_histograms_count_the_codec_codes_flush_block_by_flush_block(stats):
    recipe = _recipe()
    hists = layer_histograms(recipe, stats)
    assert sorted(hists) == [(0, "k"), (0, "v"), (1, "v")]  # 16-bit K of layer 1 skipped
    codecs = build_codecs(recipe, CONFIGS, D)
    for (i, side), hist in hists.items():
        cfg, codec = CONFIGS[i], codecs[i]
        x = reservoir_to_bhtd(getattr(stats.layers[i], f"reservoir_{side}"))  # (NB, H, BL, D)
        flush = cfg.flush_block
        want = torch.zeros_like(hist)
        for a in range(0, x.shape[2] // flush * flush, flush):  # one flush block at a time
            blk = codec.encode_keys(x[:, :, a:a + flush]) if side == "k" else codec.encode_values(x[:, :, a:a + flush])
            q = blk.quantized
            want += symbol_histogram(unpack_codes(q.codes, q.bits), q.bits)
        assert torch.equal(hist, want), (i, side)
        bits = cfg.k_bits if side == "k" else cfg.v_bits
        assert hist.shape == (1 << bits,) and hist.dtype == torch.int64
        assert int(hist.sum()) == 3 * H * (28 // flush * flush) * D  # the tail of 28 % 8 tokens is left out


def test_flush_codes_keep_token_order(stats):
    codec = build_codecs(_recipe(), CONFIGS, D)[0]
    x = reservoir_to_bhtd(stats.layers[0].reservoir_k)[:, :, :24]  # (3, H, 24, D)
    whole = unpack_codes(codec.encode_keys(x).quantized.codes, 2)  # groups of 8 never straddle blocks
    assert torch.equal(flush_codes(codec, "k", x), whole)
    with pytest.raises(ValueError, match="flush blocks"):
        flush_codes(codec, "k", x[:, :, :20])


def test_add_codebooks_tensors_provenance_and_round_trip(tmp_path, stats, coded):
    hists = layer_histograms(_recipe(), stats)
    for (i, side), hist in hists.items():
        t = coded.tensors[tensor_name(i, side)]
        assert t.dtype == torch.uint8 and t.shape == hist.shape
        assert torch.equal(t, build_codebook(hist).lengths)
    assert tensor_name(1, "k") not in coded.tensors  # 16-bit side: no codebook
    assert not any(k.endswith(HUFFMAN_HIST) for k in coded.tensors)
    for k, v in _recipe().tensors.items():  # fitted state kept
        assert torch.equal(coded.tensors[k], v)
    note = coded.provenance[HUFFMAN]
    assert note["max_len"] == 12 and note["reservoir_blocks"] == 3 and note["uncoded"] == []
    assert note["bits_per_symbol"]["k"][1] is None and 0 < note["bits_per_symbol"]["v"][0] <= 4
    assert coded.provenance["made_by"] == "test"
    build_codecs(coded, CONFIGS, D)  # the runtime accepts the recipe (huffman is informative)
    path = tmp_path / "coded.safetensors"
    coded.save(path)
    back = Recipe.load(path)
    books = load_codebooks(back, CONFIGS)
    assert sorted(books) == sorted(hists)
    assert back.provenance[HUFFMAN] == note
    again = add_codebooks(back, stats, only_if_smaller=False)  # re-running replaces, same result
    assert sorted(again.tensors) == sorted(coded.tensors)


def test_store_histograms_and_strip(stats):
    rec = add_codebooks(_recipe(), stats, store_histograms=True, only_if_smaller=False)
    hists = layer_histograms(_recipe(), stats)
    for key, h in hists.items():
        assert torch.equal(rec.tensors[tensor_name(*key, HUFFMAN_HIST)], h)
    bare = strip_codebooks(rec)
    assert sorted(bare.tensors) == sorted(_recipe().tensors) and HUFFMAN not in bare.provenance
    assert layer_histograms(rec, stats).keys() == hists.keys()  # its own tensors do not disturb the codecs


def test_only_if_smaller_codes_exactly_the_sides_that_pay(stats):
    lay = StreamLayout(tokens_per_stream=1)  # D=16: an 8-bit length per 16 symbols, 0.59 bits/symbol
    rec = add_codebooks(_recipe(), stats, layout=lay)
    hists = layer_histograms(_recipe(), stats)
    for (i, side), h in hists.items():
        bits = CONFIGS[i].k_bits if side == "k" else CONFIGS[i].v_bits
        pays = build_codebook(h).expected_bits(h) + lay.overhead_bits(D, bits) < bits
        assert (tensor_name(i, side) in rec.tensors) == pays
        assert (f"{i}.{side}" in rec.provenance[HUFFMAN]["uncoded"]) == (not pays)
    assert lay.overhead_bits(D, 2) == pytest.approx(8 / 16 + 48 / (32 * 16))


def test_preset_becomes_a_fitted_recipe(stats):
    preset = Recipe(name="p", default_layer=CONFIGS[0])
    rec = add_codebooks(preset, stats, only_if_smaller=False)
    assert rec.layers == [CONFIGS[0], CONFIGS[0]] and rec.model == stats.model
    assert sorted(load_codebooks(rec, rec.layers)) == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]


def test_add_codebooks_refusals(stats):
    other = model_info(tiny_config("llama", layers=3, kv_heads=H, head_dim=D), "other")
    with pytest.raises(RecipeError, match="model.num_layers is 2, the recipe expects 3"):  # the model is named first
        add_codebooks(Recipe(name="x", layers=[CONFIGS[0]] * 3, model=other), stats)
    with pytest.raises(RecipeError, match="16 bits"):
        add_codebooks(Recipe(name="fp", default_layer=LayerConfig()), stats)
    empty = _stats(nb=0)
    with pytest.raises(CalibrationError, match="reservoir"):
        add_codebooks(_recipe(), empty)
    tiered = _recipe()
    tiered.tensors["layers.0.kv.schedule"] = torch.tensor([[0, 2, 4], [64, 2, 2]])
    with pytest.raises(RecipeError, match="schedule"):
        add_codebooks(tiered, stats)


def _corrupt(coded: Recipe, name: str, value) -> Recipe:
    tensors = dict(coded.tensors)
    if value is None:
        tensors.pop(name)
    else:
        tensors[name] = value
    return dataclasses.replace(coded, tensors=tensors)


def _lengths(coded: Recipe, name: str, i: int, val: int) -> torch.Tensor:
    t = coded.tensors[name].clone()
    t[i] = val
    return t


@pytest.mark.parametrize(("name", "make", "match"), [
    ("layers.0.k.huffman", lambda c: torch.ones(4, dtype=torch.uint8), "Kraft sum .* > 1"),
    ("layers.0.k.huffman", lambda c: torch.tensor([2, 2, 2, 3], dtype=torch.uint8), "Kraft sum .* < 1"),
    ("layers.0.v.huffman", lambda c: _lengths(c, "layers.0.v.huffman", 0, 13), "code length 13"),
    ("layers.0.v.huffman", lambda c: _lengths(c, "layers.0.v.huffman", 5, 0), "code length 0"),
    ("layers.0.k.huffman", lambda c: torch.full((16,), 4, dtype=torch.uint8), "needs \\(4,\\) entries"),
    ("layers.0.k.huffman", lambda c: torch.ones(2, 2, dtype=torch.uint8), "needs \\(4,\\) entries"),
    ("layers.0.k.huffman", lambda c: torch.tensor([1.0, 2.0, 3.0, 3.0]), "uint8"),
    ("layers.1.k.huffman", lambda c: torch.tensor([1, 2, 3, 3], dtype=torch.uint8), "16 bits"),
    ("layers.7.v.huffman", lambda c: torch.tensor([1, 2, 3, 3], dtype=torch.uint8), "model has 2 layers"),
    ("layers.0.kv.huffman", lambda c: torch.tensor([1, 2, 3, 3], dtype=torch.uint8), "k or v"),
    ("layers.x.v.huffman", lambda c: torch.tensor([1, 2, 3, 3], dtype=torch.uint8), "not a number"),
    ("layers.1.v.huffman_hist", lambda c: torch.tensor([1, -2, 3, 3]), "negative"),
    ("layers.1.v.huffman_hist", lambda c: torch.ones(4), "integer counts"),
], ids=["overfull", "incomplete", "too_long", "zero_length", "wrong_size", "2d", "float", "16bit_side",
        "no_such_layer", "bad_side", "bad_index", "negative_hist", "float_hist"])
def test_corrupt_codebook_tensors_raise_recipe_error_naming_them(coded, name, make, match):
    bad = _corrupt(coded, name, make(coded))
    with pytest.raises(RecipeError, match=match) as err:
        load_codebooks(bad, CONFIGS)
    assert name in str(err.value)


def test_codebook_bits_sources(stats, coded):
    hists = layer_histograms(_recipe(), stats)
    books = load_codebooks(coded, CONFIGS)
    want = {k: books[k].expected_bits(h) for k, h in hists.items()}
    got, src = codebook_bits(coded, CONFIGS, hists)
    assert src == "histograms" and got == pytest.approx(want)
    got, src = codebook_bits(coded, CONFIGS)  # from the provenance note (4 decimals)
    assert src.startswith("calibration estimate") and got == pytest.approx(want, abs=1e-4)
    with_hist = add_codebooks(_recipe(), stats, store_histograms=True, only_if_smaller=False)
    got, src = codebook_bits(with_hist, CONFIGS)
    assert src == "calibration histogram" and got == pytest.approx(want)
    bare = dataclasses.replace(coded, provenance={})
    got, src = codebook_bits(bare, CONFIGS)
    assert src == "implied by the code lengths" and got == {k: implied_bits(b) for k, b in books.items()}
    assert codebook_bits(_recipe(), CONFIGS) == ({}, "none")


def test_implied_bits_of_a_dyadic_code():
    cb = build_codebook(torch.tensor([400, 200, 100, 100]))
    assert sorted(cb.lengths.tolist()) == [1, 2, 3, 3]
    assert implied_bits(cb) == pytest.approx(1.75)


# ----------------------------------------------------------------------------------------------
# the cache stream layout


def _sample(probs: torch.Tensor, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(probs.double(), n, replacement=True, generator=g).reshape(shape).to(torch.uint8)


def _spec_decode_cache(cs: CacheStreams, cb) -> torch.Tensor:
    """Module docstring point 5, literally, one lane at a time with python ints."""
    payload = [int(v) for v in cs.payload.tolist()]
    b_, h_, n_, d_ = cs.shape
    tps, spc = cs.layout.tokens_per_stream, cs.layout.chunk_tokens // cs.layout.tokens_per_stream
    L, M, bits = cs.n_symbols, cb.max_len, cb.bits
    tsym, tlen = (t.tolist() for t in cb.decode_table())
    excess = cs.stream_excess.long().tolist()
    words = cs.chunk_word.tolist()
    out = torch.empty(cs.shape, dtype=torch.uint8)
    for b in range(b_):
        for h in range(h_):
            for s in range(n_ // tps):
                c = s // spc
                p = 32 * words[b][h][c] + sum(L + excess[b][h][s2] for s2 in range(c * spc, s))
                raw = excess[b][h][s] == L * (bits - 1)
                syms = []
                for _ in range(L):
                    w, sh = p >> 5, p & 31
                    peek = (((payload[w] << 32) | payload[w + 1]) >> (64 - sh - M)) & ((1 << M) - 1)
                    sym, n = (peek >> (M - bits), bits) if raw else (tsym[peek], tlen[peek])
                    syms.append(sym)
                    p += n
                out[b, h, s * tps:(s + 1) * tps] = torch.tensor(syms, dtype=torch.uint8).reshape(tps, d_)
    return out


@st.composite
def sides(draw):
    bits = draw(st.sampled_from([2, 4, 8]))
    tps = draw(st.sampled_from([1, 2, 4]))
    chunk = tps * draw(st.sampled_from([1, 3, 8]))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n = tps * draw(st.integers(0, 11))
    d = draw(st.sampled_from([1, 3, 16, 64]))
    skew = draw(st.sampled_from([0.3, 1.0, 4.0]))
    shift = draw(st.booleans())  # serve a distribution the codebook never saw
    return bits, StreamLayout(tps, chunk), (b, h, n, d), skew, shift, draw(st.integers(0, 2**31 - 1))


@PROPERTY
@given(sides())
def test_stream_layout_round_trip_bit_exact(side):
    bits, lay, shape, skew, shift, seed = side
    k = torch.arange(1 << bits, dtype=torch.float64)
    probs = torch.exp(-k / (skew * (1 << bits) / 8))
    calib = _sample(probs, (4000,), seed)
    cb = build_codebook(symbol_histogram(calib, bits))
    codes = _sample(probs.flip(0) if shift else probs, shape, seed + 1)
    enc = encode_side(codes, cb, lay.tokens_per_stream)
    assert torch.equal(decode_side(enc, cb, shape, lay.tokens_per_stream), codes)
    cs = to_cache_streams(enc, shape, lay)
    assert torch.equal(decode_cache_streams(cs, cb), codes)
    # same streams, re-laid: sizes equal, chunks word-aligned and packed, one guard word
    starts, ends = cs.bit_ranges()
    assert torch.equal(ends - starts, enc.bit_offsets.diff())
    assert cs.stream_bits() == enc.total_bits
    chunk_bits = cs._chunk_bits().reshape(-1)
    assert cs.payload.numel() == int(((chunk_bits + 31) // 32).sum()) + 1 and int(cs.payload[-1]) == 0
    assert torch.equal(cs.raw_fallback().reshape(-1), enc.raw_fallback)
    # distribution shift costs bits, never more than raw
    L = lay.tokens_per_stream * shape[3]
    assert bool(((ends - starts) <= L * bits).all())


@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"b{b}")
def test_spec_loop_of_the_layout_matches_reference(bits):
    probs = torch.exp(-torch.arange(1 << bits, dtype=torch.float64) / 2)
    cb = build_codebook(symbol_histogram(_sample(probs, (3000,), 1), bits))
    codes = _sample(probs, (2, 3, 40, 16), 2)
    codes[1, 2, 5] = (1 << bits) - 1  # a stream of rare symbols: stored raw
    cs = encode_cache_streams(codes, cb, StreamLayout(2, 8))
    assert bool(cs.raw_fallback().any())
    assert torch.equal(_spec_decode_cache(cs, cb), codes)
    assert torch.equal(decode_cache_streams(cs, cb), codes)


def test_non_contiguous_codes():
    cb = build_codebook(torch.tensor([50, 30, 15, 5]))
    base = _sample(torch.tensor([0.5, 0.3, 0.15, 0.05]), (2, 3, 16, 24), 3)
    x = base.transpose(2, 3)  # (2, 3, 24, 16), not contiguous
    assert not x.is_contiguous()
    assert torch.equal(decode_cache_streams(encode_cache_streams(x, cb), cb), x)


def test_excess_field_width():
    assert StreamLayout().excess_dtype(64, 2) == torch.uint8  # 64 * 1 <= 255
    assert StreamLayout().excess_dtype(85, 4) == torch.uint8
    assert StreamLayout().excess_dtype(128, 4) == torch.int16
    assert StreamLayout(32, 32).excess_dtype(256, 8) == torch.int32
    with pytest.raises(ValueError, match="multiple"):
        StreamLayout(3, 32)


def test_planted_dyadic_distribution_gives_its_entropy():
    """p = (1/2, 1/4, 1/8, 1/8): Huffman is exact, 1.75 bits/symbol, and the layout adds what
    overhead_bits says (up to the padding, which it estimates at 16 bits per chunk)."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    cb = build_codebook(symbol_histogram(_sample(probs, (100_000,), 4), 2))
    assert sorted(cb.lengths.tolist()) == [1, 2, 3, 3]
    codes = _sample(probs, (1, 2, 256, 64), 5)
    cs = encode_cache_streams(codes, cb)
    bps = cs.stream_bits() / codes.numel()
    assert bps == pytest.approx(1.75, abs=0.01)
    nb = cs.nbytes()
    est = side_coded_bytes(256, 2, 64, 2, bps)
    assert est["index"] == nb["chunk_index"] + nb["stream_index"] == 2 * 8 * 4 + 2 * 256
    assert abs(est["payload"] - nb["payload"]) <= 2 * 8 * 2  # padding: estimate 16 of 0..31 bits/chunk
    total = 8 * sum(nb.values()) / codes.numel()
    assert total == pytest.approx(1.75 + StreamLayout().overhead_bits(64, 2), abs=0.02)


def test_planted_geometric_4bit_distribution_respects_the_length_limit():
    probs = 2.0 ** -torch.arange(1, 17, dtype=torch.float64)  # unlimited Huffman: lengths 1..15
    cb = build_codebook((probs * 2**40).round().long(), max_len=12)
    assert int(cb.lengths.max()) == 12
    codes = _sample(probs, (1, 1, 512, 64), 6)
    cs = encode_cache_streams(codes, cb)
    assert torch.equal(decode_cache_streams(cs, cb), codes)
    expected = cb.expected_bits(symbol_histogram(codes, 4))
    assert cs.stream_bits() / codes.numel() == pytest.approx(expected, rel=1e-9)  # no raw stream here
    assert expected < 2.05  # entropy 2.0


def _layout_fixture():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    cb = build_codebook(symbol_histogram(_sample(probs, (5000,), 7), 2))
    codes = _sample(probs, (1, 2, 40, 16), 8)
    return cb, codes, encode_cache_streams(codes, cb, StreamLayout(1, 8))


def _bump(t: torch.Tensor, idx: tuple[int, ...], delta: int) -> torch.Tensor:
    t = t.clone()
    t[idx] += delta
    return t


@pytest.mark.parametrize(("corrupt", "match"), [
    (lambda c: dataclasses.replace(c, chunk_word=_bump(c.chunk_word, (0, 0, 1), 1)), "runs into the next"),
    (lambda c: dataclasses.replace(c, chunk_word=_bump(c.chunk_word, (0, 1, 4), -3)), "runs into the next"),
    (lambda c: dataclasses.replace(c, chunk_word=_bump(c.chunk_word, (0, 0, 0), -1)), "outside the payload"),
    (lambda c: dataclasses.replace(c, chunk_word=_bump(c.chunk_word, (0, 1, 4), 10_000)), "outside the payload"),
    (lambda c: dataclasses.replace(c, stream_excess=_bump(c.stream_excess, (0, 1, 39), 100)), "outside 0..16"),
    (lambda c: dataclasses.replace(c, payload=c.payload[:-1]), "guard word"),
    (lambda c: dataclasses.replace(c, payload=c.payload[:0]), "guard word"),
    (lambda c: dataclasses.replace(c, stream_excess=c.stream_excess.to(torch.int16)), "stream_excess must be"),
    (lambda c: dataclasses.replace(c, chunk_word=c.chunk_word.long()), "chunk_word must be"),
    (lambda c: dataclasses.replace(c, shape=(1, 2, 41, 16)), "must be"),
    (lambda c: dataclasses.replace(c, bits=4), "outside the payload|runs into|must be|left|past|holds"),
], ids=["word+1", "word_back", "word<0", "word_past_end", "excess_too_big", "no_guard", "empty_payload",
        "excess_dtype", "word_dtype", "shape", "bits"])
def test_corrupt_cache_streams_raise(corrupt, match):
    cb, _, cs = _layout_fixture()
    with pytest.raises(HuffmanError, match=match):
        bad = corrupt(cs)
        decode_cache_streams(bad, cb if bad.bits == cb.bits else build_codebook(torch.ones(16, dtype=torch.int64)))


@PROPERTY
@given(st.integers(0, 79), st.sampled_from([-5, -1, 1, 3]))
def test_any_moved_stream_length_is_caught_or_well_formed(s, delta):
    """A length moved inside its valid range shifts its chunk's later streams: decoding fails with a
    HuffmanError (or, if the code happens to stay aligned, returns a well-formed tensor): no hang."""
    cb, codes, cs = _layout_fixture()
    h, t = divmod(s, 40)
    ex = cs.stream_excess.long()
    new = int(ex[0, h, t]) + delta
    if not 0 <= new <= 16:
        return
    try:
        bad = dataclasses.replace(cs, stream_excess=_bump(cs.stream_excess, (0, h, t), delta))
        out = decode_cache_streams(bad, cb)
    except HuffmanError:
        return
    assert out.shape == codes.shape and out.dtype == torch.uint8


@PROPERTY
@given(st.integers(0, 2**31 - 1), st.integers(1, 6))
def test_payload_bit_flips_never_hang(seed, n_flips):
    cb, codes, cs = _layout_fixture()
    rng = np.random.default_rng(seed)
    payload = cs.payload.numpy().copy()
    for bit in rng.integers(0, 32 * (payload.shape[0] - 1), size=n_flips):
        payload[bit >> 5] ^= np.uint32(1 << (31 - (bit & 31)))
    try:
        out = decode_cache_streams(dataclasses.replace(cs, payload=torch.from_numpy(payload)), cb)
    except HuffmanError:
        return
    assert out.shape == codes.shape


def test_decode_side_refuses_a_wrong_shape():
    cb = build_codebook(torch.ones(4, dtype=torch.int64))
    enc = encode_side(torch.zeros(1, 2, 4, 8, dtype=torch.uint8), cb)
    with pytest.raises(HuffmanError, match="do not hold"):
        decode_side(enc, cb, (1, 2, 4, 4))
    with pytest.raises(HuffmanError, match="streams of 3 tokens"):
        encode_side(torch.zeros(1, 2, 4, 8, dtype=torch.uint8), cb, tokens_per_stream=3)
    with pytest.raises(HuffmanError, match="\\(B, H, N, D\\)"):
        encode_side(torch.zeros(2, 4, 8, dtype=torch.uint8), cb)


# ----------------------------------------------------------------------------------------------
# memory


def test_entropy_memory_replaces_only_the_coded_code_bytes(coded):
    info = _info()
    context = 200
    books = load_codebooks(coded, CONFIGS)
    bps = {(0, "k"): 1.5, (0, "v"): 3.0, (1, "v"): 1.25}
    lay = StreamLayout(1, 32)
    mem = entropy_memory(coded, info, bps, context, lay)
    assert mem.uncoded.components == strip_codebooks(coded).memory(info, context).components
    base = coded.memory(info, context).components
    c = mem.coded.components
    assert "k_codes" not in c and "v_codes" not in c  # every quantized side is coded here
    for key in ("full_precision", "k_scales", "v_scales", "recipe_state", "v_mean"):
        assert c[key] == base[key]  # everything else counted as Recipe.memory counts it
    assert base["recipe_state"] - mem.uncoded.components["recipe_state"] == 4 + 16 + 4  # uint8 lengths
    # by hand: bytes of each coded side
    want_payload = {"k": 0.0, "v": 0.0}
    want_index = {"k": 0.0, "v": 0.0}
    tables = 0.0
    for (i, side), b in bps.items():
        nq = quantized_token_count(CONFIGS[i], context)
        chunks = H * math.ceil(nq / 32)
        want_payload[side] += b * H * nq * D / 8 + 2 * chunks + 4
        want_index[side] += 4 * chunks + H * nq * 1  # uint8 excess: D * (bits-1) <= 48
        tables += 2 * 2 ** int(books[(i, side)].lengths.max())
    for side in "kv":
        assert c[f"{side}_huffman_payload"] == pytest.approx(want_payload[side])
        assert c[f"{side}_huffman_index"] == pytest.approx(want_index[side])
    assert c["huffman_tables"] == pytest.approx(tables)
    assert mem.coded.elements == mem.uncoded.elements
    assert 0 < mem.reduction < 1
    with pytest.raises(ValueError, match="lacks"):
        entropy_memory(coded, info, {(0, "k"): 1.0}, context)


def test_entropy_memory_at_raw_bits_costs_only_the_overhead(coded):
    info = _info()
    bps = {(0, "k"): 2.0, (0, "v"): 4.0, (1, "v"): 2.0}
    mem = entropy_memory(coded, info, bps, 4096)
    extra = mem.coded.total_bytes - coded.memory(info, 4096).total_bytes
    overhead = sum(s["coded_bytes"] - s["raw_bytes"] for s in mem.sides)
    assert extra == pytest.approx(overhead) and overhead > 0
    assert mem.reduction < 0  # coding incompressible codes only adds the index


def test_entropy_memory_counts_sliding_layers_up_to_their_window():
    info = model_info(tiny_config("gemma3", layers=2, kv_heads=1, head_dim=16, sliding_window=64), "g")
    cfg = LayerConfig(k_bits=2, v_bits=2, k_group=8, v_group=8, window=8)
    lengths = torch.tensor([1, 2, 3, 3], dtype=torch.uint8)
    rec = Recipe(name="g", layers=[cfg, cfg], model=info,
                 tensors={tensor_name(i, s): lengths for i in range(2) for s in "kv"})
    mem = entropy_memory(rec, info, {(i, s): 1.0 for i in range(2) for s in "kv"}, 1000)
    sym = {s["layer"]: s["symbols"] for s in mem.sides if s["side"] == "k"}
    assert sym[0] == quantized_token_count(cfg, 64) * 16 and sym[1] == quantized_token_count(cfg, 1000) * 16


# ----------------------------------------------------------------------------------------------
# measurement on a tiny real model (benchmarks.huffman_bits)


@pytest.fixture(scope="module")
def tiny():
    from tests.conftest import tiny_model

    return tiny_model("llama")


def test_capture_kv_records_what_the_cache_stores(tiny):
    from benchmarks.huffman_bits import capture_kv

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    ks, vs = capture_kv(tiny, ids)
    with torch.no_grad():
        cache = tiny(input_ids=ids, use_cache=True).past_key_values
    for i in range(2):
        assert torch.allclose(ks[i], cache.layers[i].keys.float(), atol=1e-6, rtol=0)
        assert torch.allclose(vs[i], cache.layers[i].values.float(), atol=1e-6, rtol=0)
    assert tiny.config._attn_implementation == "sdpa"  # restored


def test_heldout_and_drift_on_a_tiny_model(tiny):
    from kvcalib.collection import collect_stats
    from benchmarks.huffman_bits import EntropyConfig, capture_kv, drift_check, heldout_bits

    g = torch.Generator().manual_seed(1)
    stats = collect_stats(tiny, torch.randint(0, 128, (4, 64), generator=g), reservoir_blocks=4, block_len=32,
                          progress=False)
    info = stats.model
    cfg = LayerConfig(k_bits=2, v_bits=4, k_group=8, v_group=8, window=16)
    recipe = Recipe(name="t", layers=[cfg, cfg], model=info)
    hists = layer_histograms(recipe, stats)
    coded = add_codebooks(recipe, stats, only_if_smaller=False)
    config = EntropyConfig(samples=2, seq_len=48, context=256, drift_prompt_len=16, drift_new_tokens=16,
                           drift_window=8, chunk_tokens=8)
    kv = [capture_kv(tiny, torch.randint(0, 128, (1, 48), generator=g)) for _ in range(2)]
    res = heldout_bits(coded, info, hists, kv, config)  # verify=True: every side decoded bit-exactly
    assert len(res["layers"]) == 4
    for row in res["layers"]:
        assert 1.0 <= row["heldout_bits_per_symbol"] <= row["bits"]
        assert row["symbols"] == 2 * info.num_kv_heads * 16 * quantized_token_count(cfg, 48)  # 2 samples
    e = res["effective_bits"]
    assert e["entropy_bound"] <= e["uncoded"] and e["coded_heldout"] == e["coded_heldout_all_sides"]
    assert e["reduction_pct"] == pytest.approx(100 * (1 - e["coded_heldout"] / e["uncoded"]), abs=0.01)
    rows = drift_check(coded, info, hists, capture_kv(tiny, torch.randint(0, 128, (1, 32), generator=g)),
                       16, 16, config)
    assert [r["window"] for r in rows] == ["prompt", "1-8", "9-16"]
    for r in rows:
        for side in "kv":
            assert 1.0 <= r[side]["heldout_bits_per_symbol"] <= (cfg.k_bits if side == "k" else cfg.v_bits)
    from dataclasses import replace

    from kvcalib.errors import KvcalibError
    from benchmarks.huffman_bits import markdown_report, measure_recipe

    drift_kv = capture_kv(tiny, torch.randint(0, 128, (1, 32), generator=g))
    _, full = measure_recipe(recipe, stats, info, kv, drift_kv, 16, 16,
                             replace(config, sweep_tokens_per_stream=(2, 8)))
    assert [s["tokens_per_stream"] for s in full["layout_sweep"]] == [2, 8]
    assert len(full["drift"]) == 3 and full["effective_bits"]["uncoded"] == e["uncoded"]
    md = markdown_report({"model": {"name": "tiny"}, "config": replace(config, sweep_tokens_per_stream=(2, 8)).to_dict(),
                          "statistics": "s", "recipes": [full], "kvcalib_version": "0", "threads": 1,
                          "wall_seconds": 0.0})
    assert "| t |" in md and "2 token(s)/stream" in md and "| t | 1-8 |" in md
    with pytest.raises(KvcalibError, match="flush block"):
        drift_check(coded, info, hists, capture_kv(tiny, torch.randint(0, 128, (1, 32), generator=g)), 12, 16,
                    config)
