"""Reference Huffman codec: codebooks, the block format, round trips (bit-exact) and corruption."""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcalib.quant.huffman import (
    DEFAULT_MAX_LEN,
    MAX_SUPPORTED_LEN,
    Codebook,
    EncodedBlocks,
    HuffmanError,
    build_codebook,
    decode_bit_ranges,
    decode_blocks,
    encode_blocks,
    encoded_bits_per_symbol,
    symbol_histogram,
)

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BITS = [1, 2, 4, 8]


# ----------------------------------------------------------------------------------------------
# oracles and helpers (test-only; the library's own reference is kvcalib.quant.huffman)


def _kraft_units(lengths: np.ndarray, max_len: int) -> int:
    return int(sum(1 << (max_len - int(l)) for l in lengths))


def _is_prefix_free(lengths: np.ndarray, codes: np.ndarray) -> bool:
    n = len(lengths)
    for i in range(n):
        for j in range(n):
            if i != j and lengths[i] <= lengths[j]:
                if codes[j] >> (lengths[j] - lengths[i]) == codes[i]:
                    return False
    return True


def _huffman_cost(weights: list[int]) -> int:
    """Unlimited Huffman cost sum(w * len) via the classic merge (cost = sum of merged weights)."""
    heap = list(weights)
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


def _huffman_depth(weights: list[int]) -> int:
    heap = [(w, 0, i) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    k = len(weights)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        heapq.heappush(heap, (a[0] + b[0], max(a[1], b[1]) + 1, k))
        k += 1
    return heap[0][1]


def _build_weights(hist: np.ndarray) -> list[int]:
    """The weights build_codebook optimises: 2 * count, unseen symbols 1 (pseudo-count 1/2)."""
    return [2 * int(h) if h > 0 else 1 for h in hist]


def _spec_decode(enc: EncodedBlocks, cb: Codebook) -> torch.Tensor:
    """The module docstring's per-stream loop, literally, with python ints (one lane at a time)."""
    payload = [int(v) for v in enc.payload.tolist()]
    off = enc.bit_offsets.tolist()
    raw = enc.raw_fallback.tolist()
    tsym, tlen = (t.tolist() for t in cb.decode_table())
    M, b, L = cb.max_len, cb.bits, enc.n_symbols
    out = torch.empty(len(raw), L, dtype=torch.uint8)
    for i in range(len(raw)):
        p = off[i]
        for k in range(L):
            w, s = p >> 5, p & 31
            window = (payload[w] << 32) | payload[w + 1]
            peek = (window >> (64 - s - M)) & ((1 << M) - 1)
            sym, n = (peek >> (M - b), b) if raw[i] else (tsym[peek], tlen[peek])
            out[i, k] = sym
            p += n
        assert p == off[i + 1]
    return out


@st.composite
def histograms(draw, bits: int | None = None):
    """(bits, int64 histogram) with zeros, huge and tiny counts mixed."""
    b = draw(st.sampled_from(BITS)) if bits is None else bits
    n = 1 << b
    kind = draw(st.sampled_from(["uniform", "sparse", "geometric", "single", "zeros"]))
    if kind == "uniform":
        h = draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    elif kind == "sparse":
        h = draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, 7, 1000]), min_size=n, max_size=n))
    elif kind == "geometric":  # deep unlimited Huffman trees: the length limit binds
        ratio = draw(st.sampled_from([1.5, 2.0, 3.0]))
        h = [int(ratio ** min(i, int(60 / math.log2(ratio)))) for i in range(n)]  # < 2**61
        perm = draw(st.permutations(range(n)))
        h = [h[p] for p in perm]
    elif kind == "single":
        h = [0] * n
        h[draw(st.integers(0, n - 1))] = draw(st.integers(1, 10**9))
    else:
        h = [0] * n
    return b, torch.tensor(h, dtype=torch.int64)


def _sample(probs: torch.Tensor, shape: tuple[int, int], seed: int) -> torch.Tensor:
    if shape[0] * shape[1] == 0:
        return torch.empty(shape, dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    flat = torch.multinomial(probs.double(), shape[0] * shape[1], replacement=True, generator=g)
    return flat.reshape(shape).to(torch.uint8)


def _laplacian_probs(bits: int, scale: float) -> torch.Tensor:
    k = torch.arange(1 << bits, dtype=torch.float64)
    center = ((1 << bits) - 1) / 2
    return torch.exp(-(k - center).abs() / scale)


# ----------------------------------------------------------------------------------------------
# codebooks


@PROPERTY
@given(histograms(), st.data())
def test_codebook_is_complete_prefix_free_and_limited(bh, data):
    bits, hist = bh
    max_len = data.draw(st.integers(max(bits, 1), MAX_SUPPORTED_LEN), label="max_len")
    cb = build_codebook(hist, max_len=max_len)
    lengths = cb.lengths.numpy().astype(np.int64)
    codes = cb.codes.numpy().astype(np.int64)
    assert cb.bits == bits and cb.max_len == max_len
    assert cb.lengths.dtype == torch.uint8 and cb.codes.dtype == torch.int32
    assert lengths.min() >= 1 and lengths.max() <= max_len  # every symbol, seen or not, has a code
    assert _kraft_units(lengths, max_len) == 1 << max_len  # Kraft equality: complete code
    assert np.all(codes < (1 << lengths))
    if bits <= 4:  # pairwise check is O(n^2); 8-bit codes are covered by the table test below
        assert _is_prefix_free(lengths, codes)
    # canonical code is reproducible from the lengths alone (what the recipe stores)
    again = Codebook.from_lengths(cb.lengths.clone(), max_len=max_len)
    assert torch.equal(again.codes, cb.codes) and torch.equal(again.lengths, cb.lengths)
    # the build is deterministic
    assert torch.equal(build_codebook(hist.clone(), max_len=max_len).lengths, cb.lengths)


@PROPERTY
@given(histograms())
def test_decode_table_maps_every_window_to_its_prefix(bh):
    bits, hist = bh
    cb = build_codebook(hist)
    sym, ln = cb.decode_table()
    M = cb.max_len
    assert sym.shape == ln.shape == (1 << M,) and sym.dtype == ln.dtype == torch.uint8
    idx = torch.arange(1 << M)
    s = sym.long()
    # the code word of the looked-up symbol is the prefix of the window: prefix-free + complete
    assert torch.equal(ln.long(), cb.lengths.long()[s])
    assert torch.equal(idx >> (M - ln.long()), cb.codes.long()[s])
    # every symbol owns exactly 2**(M - len) entries
    counts = torch.bincount(s, minlength=1 << bits)
    assert torch.equal(counts, 1 << (M - cb.lengths.long()))


@PROPERTY
@given(histograms())
def test_package_merge_is_optimal(bh):
    """Same cost as unlimited Huffman whenever that fits the limit; never below it."""
    _, hist = bh
    w = _build_weights(hist.numpy())
    cb = build_codebook(hist)
    cost = sum(wi * int(li) for wi, li in zip(w, cb.lengths.tolist()))
    huff = _huffman_cost(w)
    if _huffman_depth(w) <= cb.max_len:
        assert cost == huff
    else:
        assert cost >= huff


def test_length_limit_binds_on_deep_trees():
    # Fibonacci counts make the deepest possible unlimited Huffman tree (depth n - 1 = 15)
    fib = [1, 1]
    while len(fib) < 16:
        fib.append(fib[-1] + fib[-2])
    hist = torch.tensor(fib, dtype=torch.int64)
    for max_len in (4, 6, 8, 12):
        cb = build_codebook(hist, max_len=max_len)
        assert int(cb.lengths.max()) <= max_len
        assert _kraft_units(cb.lengths.numpy(), max_len) == 1 << max_len
    assert int(build_codebook(hist, max_len=16).lengths.max()) > 12  # the limit really bound


def test_skewed_codes_shrink_and_entropy_bounds():
    hist = (1e6 * _laplacian_probs(4, 1.0)).round().to(torch.int64)
    cb = build_codebook(hist)
    p = hist.double() / hist.sum()
    entropy = float(-(p * p.log2()).sum())
    avg = cb.expected_bits(hist)
    assert entropy <= avg < entropy + 1
    assert avg < 3.0


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_all_zero_histogram_gives_uniform_code(bits):
    cb = build_codebook(torch.zeros(1 << bits, dtype=torch.int64))
    assert torch.equal(cb.lengths, torch.full((1 << bits,), bits, dtype=torch.uint8))
    assert torch.equal(cb.codes, torch.arange(1 << bits, dtype=torch.int32))


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_single_symbol_histogram(bits):
    n = 1 << bits
    hist = torch.zeros(n, dtype=torch.int64)
    hist[n // 3] = 12345
    cb = build_codebook(hist)
    assert int(cb.lengths[n // 3]) == 1
    assert cb.expected_bits(hist) == 1.0
    # the seen symbol alone codes at 1 bit/symbol (raw when b == 1: same size)
    x = torch.full((3, 37), n // 3, dtype=torch.uint8)
    enc = encode_blocks(x, cb)
    assert torch.equal(decode_blocks(enc, cb), x)
    assert encoded_bits_per_symbol(enc) == 1.0
    # unseen symbols still encode exactly
    y = torch.arange(n, dtype=torch.uint8).repeat(2, 1)
    assert torch.equal(decode_blocks(encode_blocks(y, cb), cb), y)


def test_alphabet_of_two():
    cb = build_codebook(torch.tensor([5, 0]))
    assert cb.bits == 1 and cb.lengths.tolist() == [1, 1]
    x = _sample(torch.tensor([0.5, 0.5]), (9, 13), seed=0)
    enc = encode_blocks(x, cb)
    assert bool(enc.raw_fallback.all())  # coded == raw size -> stored raw
    assert torch.equal(decode_blocks(enc, cb), x)
    assert encoded_bits_per_symbol(enc) == 1.0


def test_huge_counts_do_not_overflow():
    hist = torch.tensor([2**62, 2**61, 3, 0], dtype=torch.int64)
    cb = build_codebook(hist)
    assert cb.lengths.tolist() == [1, 2, 3, 3]


def test_expected_bits():
    cb = Codebook.from_lengths(torch.tensor([1, 2, 3, 3], dtype=torch.uint8))
    assert cb.expected_bits(torch.tensor([4, 2, 1, 1])) == (4 + 4 + 3 + 3) / 8
    with pytest.raises(HuffmanError, match="at least one count"):
        cb.expected_bits(torch.zeros(4, dtype=torch.int64))
    assert cb.nbytes() == 4


# ----------------------------------------------------------------------------------------------
# invalid histograms, parameters and codebooks


@pytest.mark.parametrize(
    ("hist", "match"),
    [
        (torch.tensor([1, 2, 3]), "2\\*\\*b entries"),
        (torch.tensor([5]), "2\\*\\*b entries"),
        (torch.zeros(512, dtype=torch.int64), "2\\*\\*b entries"),
        (torch.tensor([1, -1, 2, 3]), "negative"),
        (torch.tensor([1.0, 2.0]), "integer counts"),
        (torch.tensor([True, False]), "integer counts"),
        (torch.ones(2, 2, dtype=torch.int64), "1-D"),
        ([1, 2], "torch.Tensor"),
    ],
    ids=["size3", "size1", "size512", "negative", "float", "bool", "2d", "list"],
)
def test_build_codebook_rejects_bad_histograms(hist, match):
    with pytest.raises(HuffmanError, match=match):
        build_codebook(hist)


@pytest.mark.parametrize(
    ("bits", "max_len"), [(8, 7), (4, 3), (2, 17), (2, 0), (2, 2.0)], ids=str
)
def test_build_codebook_rejects_bad_max_len(bits, max_len):
    with pytest.raises(HuffmanError, match="max_len"):
        build_codebook(torch.ones(1 << bits, dtype=torch.int64), max_len=max_len)


@pytest.mark.parametrize(
    ("lengths", "max_len", "match"),
    [
        ([1, 1, 1, 1], 12, "Kraft sum .* > 1"),
        ([1, 2, 2, 2], 12, "Kraft sum .* > 1"),
        ([2, 2, 2, 3], 12, "Kraft sum .* < 1"),
        ([1, 2, 3, 0], 12, "symbol 3 has code length 0"),
        ([1, 2, 3, 13], 12, "symbol 3 has code length 13"),
        ([1, 2, 4, 4], 3, "symbol 2 has code length 4"),
        ([1, 2, 3, 259], 12, "symbol 3 has code length 259"),  # would wrap to 3 as uint8
        ([1, 2, 3], 12, "2\\*\\*b entries"),
        ([1] * 512, 12, "2\\*\\*b entries"),
    ],
    ids=[
        "kraft>1", "kraft>1b", "incomplete", "zero", "gt_max_len", "gt_small_limit", "wrap",
        "size3", "size512",
    ],
)
def test_corrupt_lengths_raise(lengths, max_len, match):
    with pytest.raises(HuffmanError, match=match):
        Codebook.from_lengths(torch.tensor(lengths, dtype=torch.int64), max_len=max_len)


def test_corrupt_codebook_fields_raise():
    good = Codebook.from_lengths(torch.tensor([1, 2, 3, 3], dtype=torch.uint8))
    with pytest.raises(HuffmanError, match="not the canonical code"):
        dataclasses.replace(good, codes=torch.tensor([1, 0, 6, 7], dtype=torch.int32))
    with pytest.raises(HuffmanError, match="dtype"):
        dataclasses.replace(good, lengths=good.lengths.to(torch.int64))
    with pytest.raises(HuffmanError, match="needs 16 lengths"):
        dataclasses.replace(good, bits=4)
    with pytest.raises(HuffmanError, match="integer tensor"):
        Codebook.from_lengths(torch.tensor([1.0, 1.0]))


def test_symbol_histogram():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (7, 3, 11), generator=g, dtype=torch.uint8)
    h = symbol_histogram(codes.transpose(0, 2), 4)  # non-contiguous input
    assert h.dtype == torch.int64 and h.shape == (16,)
    assert torch.equal(h, torch.from_numpy(np.bincount(codes.numpy().ravel(), minlength=16)))
    empty = symbol_histogram(torch.empty(0, dtype=torch.uint8), 2)
    assert torch.equal(empty, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(HuffmanError, match="outside the 2-bit alphabet"):
        symbol_histogram(torch.tensor([0, 4], dtype=torch.uint8), 2)
    with pytest.raises(HuffmanError, match="uint8"):
        symbol_histogram(torch.tensor([0, 1]), 2)
    with pytest.raises(HuffmanError, match="bits"):
        symbol_histogram(torch.tensor([0, 1], dtype=torch.uint8), 9)


# ----------------------------------------------------------------------------------------------
# block format: exact layout


def test_block_layout_is_msb_first_and_unaligned():
    cb = Codebook.from_lengths(torch.tensor([1, 2, 3, 3], dtype=torch.uint8))
    assert cb.codes.tolist() == [0b0, 0b10, 0b110, 0b111]
    x = torch.tensor([[1, 2, 3, 0], [3, 3, 3, 3], [0, 0, 0, 0]], dtype=torch.uint8)
    enc = encode_blocks(x, cb)
    # row 0 codes to 10 110 111 0 = 9 bits > 8 raw -> stored raw 01 10 11 00; row 1 codes to
    # 12 bits -> raw 11 11 11 11; row 2 codes to 0 0 0 0 (4 bits)
    assert enc.raw_fallback.tolist() == [True, True, False]
    assert enc.bit_offsets.tolist() == [0, 8, 16, 20]
    bits = "01101100" + "11111111" + "0000"
    word0 = int(bits.ljust(32, "0"), 2)
    assert enc.payload.dtype == torch.uint32
    assert enc.payload.tolist() == [word0, 0]  # ceil(20 / 32) = 1 word + the zero guard word
    assert enc.nbytes() == 2 * 4 + 4 * 8 + 3 * 1

    y = torch.tensor([[1, 2, 0, 0], [0, 0, 0, 0]], dtype=torch.uint8)  # coded 7 bits, then 4
    enc = encode_blocks(y, cb)
    assert enc.raw_fallback.tolist() == [False, False]
    assert enc.bit_offsets.tolist() == [0, 7, 11]
    assert enc.payload.tolist() == [int("1011000" "0000".ljust(32, "0"), 2), 0]


def test_streams_cross_word_boundaries():
    # 3-bit raw streams of odd length start at every bit phase and straddle words
    cb = build_codebook(torch.ones(8, dtype=torch.int64))  # uniform 3-bit code
    x = _sample(torch.ones(8), (41, 7), seed=3)
    enc = encode_blocks(x, cb)
    assert enc.bit_offsets.tolist() == list(range(0, 42 * 21, 21))
    assert enc.payload.numel() == math.ceil(41 * 21 / 32) + 1
    assert torch.equal(decode_blocks(enc, cb), x)
    assert torch.equal(_spec_decode(enc, cb), x)


# ----------------------------------------------------------------------------------------------
# round trips


@PROPERTY
@given(histograms(), st.data())
def test_round_trip_bit_exact(bh, data):
    bits, hist = bh
    n = data.draw(st.integers(0, 40), label="N")
    L = data.draw(st.sampled_from([0, 1, 3, 7, 32, 33, 128, 129]), label="L")
    max_len = data.draw(st.integers(bits, MAX_SUPPORTED_LEN), label="max_len")
    cb = build_codebook(hist, max_len=max_len)
    # streams from the codebook's own distribution, a uniform one (hits pseudo-count symbols),
    # or the reversed one (adversarial shift)
    source = data.draw(st.sampled_from(["same", "uniform", "reversed"]), label="source")
    probs = hist.double() + 1e-3
    if source == "uniform":
        probs = torch.ones(1 << bits)
    elif source == "reversed":
        probs = probs.flip(0)
    x = _sample(probs, (n, L), seed=data.draw(st.integers(0, 2**31 - 1), label="seed"))
    enc = encode_blocks(x, cb)
    out = decode_blocks(enc, cb)
    assert out.dtype == torch.uint8 and out.shape == (n, L)
    assert torch.equal(out, x)
    # the escape: no stream is ever longer than raw
    sizes = enc.bit_offsets.diff()
    assert bool((sizes <= L * bits).all())
    assert torch.equal(enc.raw_fallback, sizes == L * bits)
    assert enc.payload.numel() == (enc.total_bits + 31) // 32 + 1
    if n * L:
        assert encoded_bits_per_symbol(enc) <= bits
    # coded streams take exactly their code words' lengths
    coded = ~enc.raw_fallback
    row_bits = cb.lengths.long()[x.long()].sum(1)
    assert torch.equal(sizes[coded], row_bits[coded])


@PROPERTY
@given(histograms(bits=4), st.integers(0, 2**31 - 1))
def test_spec_loop_matches_reference_decoder(bh, seed):
    """The docstring's per-lane loop (what the Triton kernel implements) decodes the same."""
    _, hist = bh
    cb = build_codebook(hist, max_len=DEFAULT_MAX_LEN)
    x = _sample(hist.double() + 0.1, (6, 19), seed=seed)
    enc = encode_blocks(x, cb)
    assert torch.equal(_spec_decode(enc, cb), decode_blocks(enc, cb))


@pytest.mark.parametrize("bits", [2, 4, 8], ids=lambda b: f"b{b}")
def test_adversarial_shift_costs_bits_not_correctness(bits):
    n = 1 << bits
    skew = torch.exp(-torch.arange(n, dtype=torch.float64) / max(1.0, n / 8))
    hist = (1e6 * skew).round().to(torch.int64)
    hist[n // 2 :] = 0  # half the alphabet never seen in calibration
    cb = build_codebook(hist)
    x = _sample(skew.flip(0), (64, 128), seed=7)  # serve the opposite distribution
    enc = encode_blocks(x, cb)
    assert torch.equal(decode_blocks(enc, cb), x)
    bps = encoded_bits_per_symbol(enc)
    assert cb.expected_bits(hist) < bps <= bits
    assert bool(enc.raw_fallback.any())


def test_laplacian_4bit_codes_shrink_below_3_bits():
    probs = _laplacian_probs(4, 1.0)  # entropy 2.50 bits
    calib = _sample(probs, (256, 128), seed=11)
    cb = build_codebook(symbol_histogram(calib, 4))
    x = _sample(probs, (512, 128), seed=12)  # held-out tokens, same distribution
    enc = encode_blocks(x, cb)
    assert torch.equal(decode_blocks(enc, cb), x)
    assert encoded_bits_per_symbol(enc) < 3.0
    # honest memory: + 64-bit offsets (N+1), 8-bit flags (N), word padding and the guard word
    n, L = x.shape
    held = 32 * enc.payload.numel() + 64 * (n + 1) + 8 * n
    assert 32 * enc.payload.numel() - enc.total_bits in range(32, 64)
    assert encoded_bits_per_symbol(enc, include_overhead=True) == held / (n * L)
    assert encoded_bits_per_symbol(enc, include_overhead=True) < 3.0 + (64 + 8) / L + 0.01


@pytest.mark.parametrize(
    "layout", ["transposed", "strided", "sliced"], ids=lambda s: s
)
def test_non_contiguous_symbols(layout):
    base = _sample(_laplacian_probs(4, 2.0), (96, 50), seed=5)
    x = {"transposed": base.t(), "strided": base[::3, ::2], "sliced": base[5:70, 7:40]}[layout]
    assert not x.is_contiguous()
    cb = build_codebook(symbol_histogram(base, 4))
    assert torch.equal(decode_blocks(encode_blocks(x, cb), cb), x)


def test_encode_rejects_bad_symbols():
    cb = build_codebook(torch.ones(4, dtype=torch.int64))
    with pytest.raises(HuffmanError, match="outside the codebook's 2-bit alphabet"):
        encode_blocks(torch.tensor([[0, 4]], dtype=torch.uint8), cb)
    with pytest.raises(HuffmanError, match="dtype"):
        encode_blocks(torch.tensor([[0, 1]]), cb)
    with pytest.raises(HuffmanError, match="2-D"):
        encode_blocks(torch.tensor([0, 1], dtype=torch.uint8), cb)


def test_decode_rejects_codebook_of_other_width():
    cb2 = build_codebook(torch.ones(4, dtype=torch.int64))
    cb4 = build_codebook(torch.ones(16, dtype=torch.int64))
    enc = encode_blocks(torch.zeros(2, 5, dtype=torch.uint8), cb2)
    with pytest.raises(HuffmanError, match="2-bit symbols but the codebook is 4-bit"):
        decode_blocks(enc, cb4)


def test_encoded_bits_per_symbol_empty():
    cb = build_codebook(torch.ones(4, dtype=torch.int64))
    enc = encode_blocks(torch.zeros(0, 5, dtype=torch.uint8), cb)
    assert enc.payload.tolist() == [0] and enc.bit_offsets.tolist() == [0]
    assert decode_blocks(enc, cb).shape == (0, 5)
    with pytest.raises(HuffmanError, match="no symbols"):
        encoded_bits_per_symbol(enc)


# ----------------------------------------------------------------------------------------------
# corruption: a clear HuffmanError, never a wrong shape, another exception or a hang


def _fixture(seed: int = 0) -> tuple[Codebook, torch.Tensor, EncodedBlocks]:
    probs = _laplacian_probs(4, 1.0)
    cb = build_codebook((1e5 * probs).round().to(torch.int64))
    x = _sample(probs, (12, 33), seed=seed)
    x[3] = 15 - x[3] // 8  # a stream of rare symbols: stored raw
    enc = encode_blocks(x, cb)
    assert bool(enc.raw_fallback.any()) and not bool(enc.raw_fallback.all())
    return cb, x, enc


def _replace_offsets(enc: EncodedBlocks, off: torch.Tensor) -> EncodedBlocks:
    return dataclasses.replace(enc, bit_offsets=off)


def _set(t: torch.Tensor, i: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[i] = value
    return t


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda e: _replace_offsets(e, e.bit_offsets.flip(0)), "bit_offsets\\[0\\] must be 0"),
        (
            lambda e: _replace_offsets(e, _set(e.bit_offsets, 5, int(e.bit_offsets[4]) - 1)),
            "decrease",
        ),
        (lambda e: _replace_offsets(e, e.bit_offsets + (e.bit_offsets > 0) * 10_000), "payload"),
        (lambda e: _replace_offsets(e, e.bit_offsets[:-1]), "N\\+1"),
        (lambda e: _replace_offsets(e, e.bit_offsets.to(torch.int32)), "dtype"),
        (lambda e: dataclasses.replace(e, payload=e.payload[:-1]), "truncated payload"),
        (lambda e: dataclasses.replace(e, payload=e.payload[:2]), "truncated payload"),
        (lambda e: dataclasses.replace(e, payload=e.payload.to(torch.int64)), "dtype"),
        (lambda e: dataclasses.replace(e, raw_fallback=~e.raw_fallback), "raw|coded stream"),
        (lambda e: dataclasses.replace(e, n_symbols=e.n_symbols + 1), "flagged raw"),
        (lambda e: dataclasses.replace(e, n_symbols=-1), "n_symbols"),
        (lambda e: dataclasses.replace(e, bits=9), "bits"),
    ],
    ids=["off0", "non_monotone", "past_payload_end", "short_offsets", "offsets_dtype",
         "no_guard_word", "half_payload", "payload_dtype", "flags_flipped", "n_symbols+1",
         "n_symbols<0", "bits9"],
)
def test_corrupt_blocks_raise(corrupt, match):
    cb, _, enc = _fixture()
    with pytest.raises(HuffmanError, match=match):
        decode_blocks(corrupt(enc), cb)


@PROPERTY
@given(st.integers(1, 12), st.sampled_from([-3, -1, 1, 2, 17]))
def test_any_moved_offset_is_detected(i, delta):
    """Stream i-1 still decodes its L symbols up to the old boundary, so a moved end is caught."""
    cb, _, enc = _fixture()
    off = enc.bit_offsets.clone()
    off[i] += delta
    with pytest.raises(HuffmanError):
        decode_blocks(_replace_offsets(enc, off), cb)


@PROPERTY
@given(st.integers(0, 2**31 - 1), st.integers(1, 8))
def test_payload_bit_flips_never_hang_or_crash(seed, n_flips):
    cb, x, enc = _fixture(seed % 7)
    rng = np.random.default_rng(seed)
    payload = enc.payload.numpy().copy()
    for bit in rng.integers(0, enc.total_bits, size=n_flips):
        payload[bit >> 5] ^= np.uint32(1 << (31 - (bit & 31)))
    bad = dataclasses.replace(enc, payload=torch.from_numpy(payload))
    try:
        out = decode_blocks(bad, cb)
    except HuffmanError:
        return
    # undetectable flips (alignment kept) still give a well-formed result
    assert out.shape == x.shape and out.dtype == torch.uint8


def test_decoding_with_a_different_codebook_is_caught_or_well_formed():
    cb, x, enc = _fixture()
    other = build_codebook(torch.ones(16, dtype=torch.int64) + torch.arange(16))
    try:
        out = decode_blocks(enc, other)
    except HuffmanError as err:
        assert "corrupt block" in str(err)
    else:
        assert out.shape == x.shape


# ----------------------------------------------------------------------------------------------
# decode_bit_ranges: streams at explicit bit ranges (the cache layout decodes through it)


def test_bit_ranges_decode_any_order_and_subset():
    cb, x, enc = _fixture()
    off = enc.bit_offsets
    assert torch.equal(decode_bit_ranges(enc.payload, off[:-1], off[1:], enc.raw_fallback, enc.n_symbols, cb), x)
    order = torch.tensor([7, 3, 3, 0, 11])  # any order, repeats allowed
    got = decode_bit_ranges(enc.payload, off[:-1][order], off[1:][order], enc.raw_fallback[order],
                            enc.n_symbols, cb)
    assert torch.equal(got, x[order])
    empty = decode_bit_ranges(enc.payload, off[:0], off[:0], enc.raw_fallback[:0], enc.n_symbols, cb)
    assert empty.shape == (0, enc.n_symbols)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda s, e, r: (s - 10**6, e, r), "outside the payload"),
    (lambda s, e, r: (s, e + 10**6, r), "outside the payload"),
    (lambda s, e, r: (e, s, r), "outside the payload"),  # end before start
    (lambda s, e, r: (s, e, ~r), "raw|coded stream"),
    (lambda s, e, r: (s + 1, e, r), "holds|ends after|left after|past"),
    (lambda s, e, r: (s, e[:-1], r), "one entry per stream"),
    (lambda s, e, r: (s.to(torch.int32), e, r), "dtype"),
], ids=["start<0", "end_past_payload", "swapped", "flags_flipped", "start+1", "short_ends", "dtype"])
def test_bit_ranges_corrupt_raise(mutate, match):
    cb, _, enc = _fixture()
    off = enc.bit_offsets
    starts, ends, raw = mutate(off[:-1], off[1:], enc.raw_fallback)
    with pytest.raises(HuffmanError, match=match):
        decode_bit_ranges(enc.payload, starts, ends, raw, enc.n_symbols, cb)


def test_bit_ranges_stop_at_the_guard_word():
    """A stream may end at bit 32 * (W - 1) but not inside the guard word."""
    cb, _, enc = _fixture()
    last = enc.bit_offsets[-1]
    w = enc.payload.numel()
    assert int(last) <= 32 * (w - 1)
    with pytest.raises(HuffmanError, match="outside the payload"):
        decode_bit_ranges(enc.payload[: (int(last) + 31) // 32], enc.bit_offsets[:-1], enc.bit_offsets[1:],
                          enc.raw_fallback, enc.n_symbols, cb)
