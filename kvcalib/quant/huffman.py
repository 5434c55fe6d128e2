"""Reference Huffman codec for quantized KV-cache symbols (KVComp-style entropy coding).

The symbols are the unpacked codes of a ``b``-bit quantizer (``b`` in 1..8, alphabet ``2**b``),
one code per ``uint8`` element. This module is the pure PyTorch/NumPy *specification*: the
Triton decoder (and any fused decode-attention kernel) must reproduce :func:`decode_blocks`
bit for bit, on the format described below.

Codebooks
---------
:func:`build_codebook` turns a symbol histogram into a length-limited Huffman code
(package-merge, optimal for the limit) and assigns canonical code words from the lengths alone,
so a recipe stores only ``lengths`` (``uint8``, ``(2**b,)``) and rebuilds everything with
:meth:`Codebook.from_lengths`.

* Every symbol gets a code word. Symbols with count 0 get a pseudo-count of 1/2 (half a
  sighting): they end up with long code words, so a distribution shift between calibration and
  serving costs bits, never correctness.
* Code lengths are limited to ``max_len`` (default :data:`DEFAULT_MAX_LEN` = 12) so that one
  table of ``2**max_len`` entries decodes any code word with a single lookup. 12 is the limit
  zstd uses for its Huffman tables (``HUF_TABLELOG_MAX``): the table (symbol + length, 2 bytes
  an entry) is 8 KiB, small enough for GPU shared memory / L1 next to the attention tiles;
  it is >= 8, so the 256-symbol alphabet of 8-bit codes fits; and the cost of the limit is
  nil for the histograms of 2- and 4-bit codes (their optimal codes are far shorter) and tiny
  for 8-bit ones (only symbols rarer than about 2**-12 are affected).
* Codes are *complete* (Kraft sum exactly 1). :func:`build_codebook` always makes complete codes,
  so every ``max_len``-bit window decodes to some symbol and the GPU decoder needs no "invalid
  code" path; :class:`Codebook` rejects incomplete or over-full length sets as corrupt.
* Canonical assignment (DEFLATE, RFC 1951 section 3.2.2): sort the symbols by
  (length, symbol index); the first gets code 0; each next one gets
  ``code = (previous_code + 1) << (its_length - previous_length)``. Code words are written
  most-significant bit first.

Block format (version 1)
------------------------
Input: ``symbols`` ``uint8`` ``(N, L)``, every value ``< 2**b``. Row ``i`` is *stream* ``i``:
streams are coded and decoded independently, so one GPU program (or lane) decodes one row with
a loop of ``L`` table lookups. To code ``k`` rows as one stream (fewer offsets, less
parallelism), reshape to ``(N / k, k * L)`` first.

``EncodedBlocks``:

=================  ==================  ========================================================
field              dtype, shape        meaning
=================  ==================  ========================================================
``payload``        ``uint32 (W,)``     one bit string holding all streams back to back, with
                                       no padding between them. Bit ``k`` of the string is bit
                                       ``31 - k % 32`` of ``payload[k // 32]`` (words are filled
                                       MSB-first). ``W = ceil(off[N] / 32) + 1``: the last word
                                       is a zero *guard word*, so that a 64-bit window read at
                                       any bit position ``p < off[N]`` stays in bounds. All bits
                                       at and past ``off[N]`` are zero.
``bit_offsets``    ``int64 (N+1,)``    ``off[0] == 0``, non-decreasing; stream ``i`` is bits
                                       ``[off[i], off[i+1])``. Streams start at any bit (no
                                       word alignment: aligning to 32 bits would waste 16 bits
                                       per stream on average, 6% of 128 two-bit codes).
``raw_fallback``   ``bool (N,)``       stream ``i`` is stored raw: ``L`` symbols of ``b`` bits
                                       each, MSB-first, ``off[i+1] - off[i] == L * b``.
                                       Otherwise it is ``L`` canonical code words back to back
                                       and ``L <= off[i+1] - off[i] < L * b``.
``n_symbols``      ``int``             ``L``, symbols per stream.
``bits``           ``int``             ``b``, bits per raw symbol (the codebook's ``bits``).
=================  ==================  ========================================================

The encoder stores a stream raw exactly when its coded length would be ``>= L * b`` (the
escape): coding never makes a stream longer than raw. Hence ``raw_fallback[i]`` is equivalent to
``off[i+1] - off[i] == L * b``; the flag is kept for simple decoders, and validation requires
the two to agree.

Decoding stream ``i`` (what each lane does; ``M = max_len``, ``table_symbol`` /
``table_length`` from :meth:`Codebook.decode_table`)::

    p = off[i]
    for k in range(L):
        w, s = p >> 5, p & 31
        window = (payload[w] << 32) | payload[w + 1]          # 64-bit unsigned
        peek = (window >> (64 - s - M)) & ((1 << M) - 1)      # next M bits of the stream
        if raw_fallback[i]:
            sym, n = peek >> (M - b), b
        else:
            sym, n = table_symbol[peek], table_length[peek]
        out[i, k] = sym
        p += n
    # p == off[i + 1] for a well-formed stream

``s + M <= 31 + 16 < 64``, so the window always holds the next ``M`` bits. Near the end of a
stream the peek also sees bits of the next stream or of the guard word; a prefix code ignores
them. A decoder with only 32-bit integers can form the same peek as
``x = payload[w] if s == 0 else (payload[w] << s) | (payload[w + 1] >> (32 - s))`` (32-bit),
then ``peek = x >> (32 - M)``.

:func:`decode_blocks` checks what can be checked: the structure (dtypes, shapes, monotone
offsets, payload long enough, flags consistent with lengths) and, while decoding, that no stream
runs past its end or ends with bits left over. A bit flip inside a payload that keeps every
stream aligned decodes to wrong symbols undetected (Huffman has no checksum).

:func:`decode_bit_ranges` runs the same loop on streams given by explicit ``[start, end)`` bit
ranges, for layouts that store offsets another way. The KV cache is one such layout
(:class:`StreamLayout`, :class:`CacheStreams` below; described in :mod:`kvcalib.methods.huffman`): word-aligned chunks, a 32-bit word index per chunk and an
8- or 16-bit length per stream. ``decode_blocks`` is ``decode_bit_ranges(payload, off[:-1],
off[1:], ...)``.

Memory: :meth:`EncodedBlocks.nbytes` counts payload, offsets and flags as this in-memory format
holds them (int64 offsets, one ``bool`` per stream). A GPU layout needs far less; the cache
layout's bytes are counted by :class:`CacheStreams` (below). The codebook
(:meth:`Codebook.nbytes`, ``2**b`` bytes of lengths) is shared, so the caller amortises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcalib.errors import KvcalibError

__all__ = [
    "DEFAULT_MAX_LEN",
    "MAX_SUPPORTED_LEN",
    "Codebook",
    "EncodedBlocks",
    "HuffmanError",
    "build_codebook",
    "decode_bit_ranges",
    "decode_blocks",
    "encode_blocks",
    "encoded_bits_per_symbol",
    "symbol_histogram",
    "StreamLayout",
    "CacheStreams",
    "encode_side",
    "decode_side",
    "to_cache_streams",
    "encode_cache_streams",
    "decode_cache_streams",
]

DEFAULT_MAX_LEN = 12
"""Default code-length limit: a 4096-entry (8 KiB) single-level decode table (see module doc)."""

MAX_SUPPORTED_LEN = 16
"""Largest accepted ``max_len``: a 64 Ki-entry table; keeps ``s + max_len <= 47`` in a 64-bit
window and every code word in 16 bits."""

_WORD_BITS = 32  # payload word size; bit p lives in word p >> 5
_MAX_BITS = 8  # symbols are uint8


class HuffmanError(KvcalibError, ValueError):
    """A codebook, histogram, symbol array or encoded block is invalid or corrupt."""


# ----------------------------------------------------------------------------------------------
# validation helpers


def _bits_for_alphabet(n: int, what: str) -> int:
    """Return ``b`` with ``2**b == n`` for ``n`` in 2..256, else raise."""
    if n < 2 or n > 2**_MAX_BITS or n & (n - 1):
        raise HuffmanError(
            f"{what} has {n} entries; expected 2**b entries for a b-bit quantizer, b in 1..8 "
            f"(2, 4, 16, ..., 256)"
        )
    return n.bit_length() - 1


def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= _MAX_BITS:
        raise HuffmanError(f"bits must be an int in 1..{_MAX_BITS}, got {bits!r}")
    return bits


def _check_max_len(max_len: object, bits: int) -> int:
    if (
        isinstance(max_len, bool)
        or not isinstance(max_len, int)
        or not bits <= max_len <= MAX_SUPPORTED_LEN
    ):
        raise HuffmanError(
            f"max_len must be an int in {bits}..{MAX_SUPPORTED_LEN} for a {bits}-bit alphabet "
            f"(a complete code on 2**{bits} symbols needs code words of {bits} bits or more; "
            f"the decode table has 2**max_len entries), got {max_len!r}"
        )
    return max_len


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _check_tensor(t: object, name: str, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise HuffmanError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise HuffmanError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise HuffmanError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def _canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values (MSB-first) from code lengths.  ``lengths``: (n,) ints >= 1."""
    n = lengths.shape[0]
    order = np.lexsort((np.arange(n), lengths))  # by length, then symbol index
    codes = np.zeros(n, dtype=np.int64)
    code, prev_len = 0, int(lengths[order[0]])
    for j, sym in enumerate(order):
        cur_len = int(lengths[sym])
        if j > 0:
            code = (code + 1) << (cur_len - prev_len)
        codes[sym] = code
        prev_len = cur_len
    return codes


def _check_lengths(lengths: np.ndarray, max_len: int) -> None:
    """Raise unless ``lengths`` (n,) int64 is a complete prefix code with lengths in 1..max_len."""
    bad = np.flatnonzero((lengths < 1) | (lengths > max_len))
    if bad.size:
        s = int(bad[0])
        raise HuffmanError(
            f"corrupt Huffman codebook: symbol {s} has code length {int(lengths[s])}; every "
            f"symbol needs a length in 1..{max_len} (max_len) ({bad.size} symbols out of range)"
        )
    # Kraft sum in units of 2**-max_len, exact integer arithmetic
    kraft = int(np.sum(np.left_shift(np.int64(1), max_len - lengths)))
    full = 1 << max_len
    if kraft > full:
        raise HuffmanError(
            f"corrupt Huffman codebook: Kraft sum of the code lengths is {kraft / full:.6g} > 1, "
            f"so they do not form a prefix code"
        )
    if kraft < full:
        raise HuffmanError(
            f"corrupt Huffman codebook: Kraft sum of the code lengths is {kraft / full:.6g} < 1 "
            f"(an incomplete code); build_codebook always makes complete codes"
        )


# ----------------------------------------------------------------------------------------------
# codebook


@dataclass(frozen=True, eq=False)
class Codebook:
    """A complete, length-limited canonical Huffman code over ``2**bits`` symbols.

    Build with :func:`build_codebook` or :meth:`from_lengths`; ``codes`` is always the canonical
    code of ``lengths`` (checked), so storing ``lengths`` alone is enough.

    Attributes:
        lengths: ``uint8 (2**bits,)`` code length of each symbol, in ``1..max_len``.
        codes: ``int32 (2**bits,)`` canonical code value of each symbol; its ``lengths[s]`` low
            bits are the code word, most-significant bit first in the stream.
        max_len: the length limit and decode-table width (``2**max_len`` entries). Any value
            ``>= lengths.max()`` decodes the same streams.
        bits: ``b``, the quantizer's bit width (raw size of a symbol).
    """

    lengths: torch.Tensor  # (2**bits,) uint8
    codes: torch.Tensor  # (2**bits,) int32
    max_len: int
    bits: int

    def __post_init__(self) -> None:
        bits = _check_bits(self.bits)
        max_len = _check_max_len(self.max_len, bits)
        _check_tensor(self.lengths, "Codebook.lengths", torch.uint8, 1)
        _check_tensor(self.codes, "Codebook.codes", torch.int32, 1)
        n = 1 << bits
        if self.lengths.numel() != n or self.codes.numel() != n:
            raise HuffmanError(
                f"a {bits}-bit codebook needs {n} lengths and codes, got "
                f"{self.lengths.numel()} and {self.codes.numel()}"
            )
        lengths = _as_numpy(self.lengths).astype(np.int64)
        _check_lengths(lengths, max_len)
        if not np.array_equal(_as_numpy(self.codes).astype(np.int64), _canonical_codes(lengths)):
            raise HuffmanError(
                "corrupt Huffman codebook: codes are not the canonical code of lengths; "
                "rebuild it with Codebook.from_lengths(lengths)"
            )

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, max_len: int = DEFAULT_MAX_LEN) -> Codebook:
        """Rebuild a codebook from code lengths alone (what a recipe stores).

        Args:
            lengths: integer tensor ``(2**b,)`` (``uint8`` in recipes), each in ``1..max_len``.
            max_len: decode-table width; must be ``>= lengths.max()``.

        Raises:
            HuffmanError: lengths out of range, Kraft sum != 1, wrong size or dtype.
        """
        if not isinstance(lengths, torch.Tensor):
            raise HuffmanError(f"lengths must be a torch.Tensor, got {type(lengths).__name__}")
        if lengths.dtype in (torch.bool,) or lengths.is_floating_point() or lengths.is_complex():
            raise HuffmanError(f"lengths must be an integer tensor, got dtype {lengths.dtype}")
        if lengths.dim() != 1:
            raise HuffmanError(f"lengths must be 1-D, got shape {tuple(lengths.shape)}")
        bits = _bits_for_alphabet(lengths.numel(), "lengths")
        max_len = _check_max_len(max_len, bits)
        arr = _as_numpy(lengths).astype(np.int64)  # range-check before any narrowing cast
        _check_lengths(arr, max_len)
        return cls(
            lengths=torch.from_numpy(arr.astype(np.uint8)),
            codes=torch.from_numpy(_canonical_codes(arr).astype(np.int32)),
            max_len=max_len,
            bits=bits,
        )

    def expected_bits(self, histogram: torch.Tensor) -> float:
        """Mean code length in bits/symbol of data with symbol counts ``histogram`` ``(2**b,)``.

        Does not apply the raw fallback (see :func:`encoded_bits_per_symbol` for real streams).
        """
        h = _check_histogram(histogram, self.bits).astype(np.float64)
        total = h.sum()
        if total <= 0:
            raise HuffmanError("expected_bits needs a histogram with at least one count")
        return float(np.dot(h, _as_numpy(self.lengths).astype(np.float64)) / total)

    def decode_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Single-level lookup table indexed by the next ``max_len`` stream bits (MSB-first).

        Returns:
            symbol: ``uint8 (2**max_len,)`` the symbol whose code word prefixes the index.
            length: ``uint8 (2**max_len,)`` that code word's length in bits (how far to advance).
        """
        lengths = _as_numpy(self.lengths).astype(np.int64)
        codes = _as_numpy(self.codes).astype(np.int64)
        n = lengths.shape[0]
        # canonical order == increasing left-aligned code value, so the entries of consecutive
        # symbols are consecutive table ranges [code << (M - l), (code + 1) << (M - l))
        order = np.lexsort((np.arange(n), lengths))
        span = np.left_shift(np.int64(1), self.max_len - lengths[order])
        starts = codes[order] << (self.max_len - lengths[order])
        assert starts[0] == 0 and np.all(starts[1:] == np.cumsum(span)[:-1])  # complete code
        symbol = np.repeat(order.astype(np.uint8), span)
        length = np.repeat(lengths[order].astype(np.uint8), span)
        return torch.from_numpy(symbol), torch.from_numpy(length)

    def nbytes(self) -> int:
        """Bytes a recipe stores for this codebook (the ``uint8`` lengths)."""
        return self.lengths.numel() * self.lengths.element_size()


def _check_histogram(histogram: object, bits: int | None = None) -> np.ndarray:
    """Validate a histogram tensor; return it as an int64 numpy array."""
    if not isinstance(histogram, torch.Tensor):
        raise HuffmanError(f"histogram must be a torch.Tensor, got {type(histogram).__name__}")
    if histogram.dtype == torch.bool or histogram.is_floating_point() or histogram.is_complex():
        raise HuffmanError(
            f"histogram must hold integer counts (int64), got dtype {histogram.dtype}"
        )
    if histogram.dim() != 1:
        raise HuffmanError(f"histogram must be 1-D, got shape {tuple(histogram.shape)}")
    n = histogram.numel()
    if bits is None:
        _bits_for_alphabet(n, "histogram")
    elif n != 1 << bits:
        raise HuffmanError(f"histogram has {n} entries; a {bits}-bit codebook needs {1 << bits}")
    h = _as_numpy(histogram).astype(np.int64)
    if np.any(h < 0):
        raise HuffmanError(f"histogram has negative counts at symbols {np.flatnonzero(h < 0)}")
    return h


def _package_merge(weights: np.ndarray, max_len: int) -> np.ndarray:
    """Optimal code lengths, each <= max_len, for positive integer ``weights`` (n,), n >= 2.

    Package-merge (Larmore & Hirschberg 1990): each symbol has one "coin" of its weight at every
    depth 1..max_len; starting from the deepest level, pair up the sorted items into packages and
    merge them with the leaves of the next level up. The 2n - 2 cheapest items at depth 1 pick
    the coins; a symbol's code length is how many of its coins were picked. Items are tracked
    as count vectors (item, symbol) so the whole thing is a few small matrix ops per level.
    """
    n = weights.shape[0]
    order = np.argsort(weights, kind="stable")
    leaf_w = weights[order]  # (n,)
    leaf_c = np.eye(n, dtype=np.int32)[order]  # (n, n): item -> coins per symbol
    cur_w, cur_c = leaf_w, leaf_c
    for _ in range(max_len - 1):
        m = cur_w.shape[0] // 2 * 2  # an odd last item cannot be packaged
        pkg_w = cur_w[0:m:2] + cur_w[1:m:2]
        pkg_c = cur_c[0:m:2] + cur_c[1:m:2]
        w = np.concatenate([leaf_w, pkg_w])
        c = np.concatenate([leaf_c, pkg_c])
        idx = np.argsort(w, kind="stable")  # ties: leaves first, deterministic
        cur_w, cur_c = w[idx], c[idx]
    return cur_c[: 2 * n - 2].sum(axis=0).astype(np.int64)


_WEIGHT_CAP = 1 << 40  # keeps package weights (<= max_len * sum) far below 2**63


def build_codebook(histogram: torch.Tensor, max_len: int = DEFAULT_MAX_LEN) -> Codebook:
    """Optimal length-limited canonical Huffman codebook for a symbol histogram.

    Args:
        histogram: ``int64 (2**b,)`` symbol counts (see :func:`symbol_histogram`); zeros allowed.
        max_len: code-length limit = decode-table width; default 12 (module doc says why).

    Returns:
        A complete :class:`Codebook` in which every symbol, seen or not, has a code word.
        Unseen symbols are weighted as half a sighting, so they get the longest code words.
        A histogram with a single non-zero symbol gives it a 1-bit code; an all-zero one gives
        the uniform ``b``-bit code.

    Raises:
        HuffmanError: histogram of the wrong size or dtype, negative counts, bad ``max_len``.
    """
    h = _check_histogram(histogram)
    bits = _bits_for_alphabet(h.shape[0], "histogram")
    max_len = _check_max_len(max_len, bits)
    total = sum(int(x) for x in h)  # python ints: no overflow
    if total > _WEIGHT_CAP:
        # scale down huge histograms; a seen symbol stays seen (>= 1)
        shift = (total // _WEIGHT_CAP).bit_length()
        h = np.where(h > 0, np.maximum(h >> shift, 1), 0)
    # weights in units of half a count: seen symbols 2 * count, unseen 1 (the pseudo-count)
    weights = np.where(h > 0, 2 * h, 1).astype(np.int64)
    lengths = _package_merge(weights, max_len)
    return Codebook.from_lengths(torch.from_numpy(lengths), max_len=max_len)


def symbol_histogram(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Counts of each ``b``-bit symbol in ``codes`` (``uint8``, any shape) -> ``int64 (2**b,)``."""
    bits = _check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise HuffmanError(f"codes must be a uint8 tensor of unpacked symbols, got {got}")
    flat = codes.reshape(-1)
    if flat.numel() and int(flat.max()) >= 1 << bits:
        raise HuffmanError(
            f"codes hold symbol {int(flat.max())}, outside the {bits}-bit alphabet "
            f"0..{(1 << bits) - 1}"
        )
    return torch.bincount(flat, minlength=1 << bits).to(torch.int64)


# ----------------------------------------------------------------------------------------------
# block format


@dataclass(frozen=True, eq=False)
class EncodedBlocks:
    """``N`` independently decodable streams of ``n_symbols`` symbols (format in module doc).

    Attributes:
        payload: ``uint32 (W,)`` all streams' bits, MSB-first, plus one zero guard word.
        bit_offsets: ``int64 (N+1,)`` stream ``i`` is bits ``[bit_offsets[i], bit_offsets[i+1])``.
        raw_fallback: ``bool (N,)`` stream stored raw (``bits`` bits per symbol).
        n_symbols: ``L``, symbols per stream.
        bits: ``b``, bits per raw symbol; must match the codebook's.

    Construction validates the structure and raises :class:`HuffmanError` if it is corrupt.
    """

    payload: torch.Tensor  # (W,) uint32
    bit_offsets: torch.Tensor  # (N+1,) int64
    raw_fallback: torch.Tensor  # (N,) bool
    n_symbols: int
    bits: int

    def __post_init__(self) -> None:
        bits = _check_bits(self.bits)
        L = self.n_symbols
        if isinstance(L, bool) or not isinstance(L, int) or L < 0:
            raise HuffmanError(f"n_symbols must be an int >= 0, got {L!r}")
        _check_tensor(self.payload, "payload", torch.uint32, 1)
        _check_tensor(self.bit_offsets, "bit_offsets", torch.int64, 1)
        _check_tensor(self.raw_fallback, "raw_fallback", torch.bool, 1)
        n = self.raw_fallback.numel()
        if self.bit_offsets.numel() != n + 1:
            raise HuffmanError(
                f"bit_offsets must have N+1 = {n + 1} entries for {n} streams, "
                f"got {self.bit_offsets.numel()}"
            )
        off = _as_numpy(self.bit_offsets)
        raw = _as_numpy(self.raw_fallback)
        if off[0] != 0:
            raise HuffmanError(f"corrupt block: bit_offsets[0] must be 0, got {int(off[0])}")
        size = np.diff(off)  # (N,) bits per stream
        if np.any(size < 0):
            i = int(np.flatnonzero(size < 0)[0])
            raise HuffmanError(
                f"corrupt block: bit_offsets decrease at stream {i} "
                f"({int(off[i])} -> {int(off[i + 1])}); they must be non-decreasing"
            )
        need = _payload_words(int(off[-1]))
        if self.payload.numel() < need:
            raise HuffmanError(
                f"corrupt block: streams end at bit {int(off[-1])}, which needs a payload of "
                f"{need} uint32 words (with the guard word), got {self.payload.numel()} "
                f"(truncated payload or offsets past its end)"
            )
        _check_stream_sizes(raw, size, L, bits)

    @property
    def n_streams(self) -> int:
        """``N``, the number of streams."""
        return self.raw_fallback.numel()

    @property
    def total_bits(self) -> int:
        """Bits used by all streams (``bit_offsets[-1]``), excluding the guard word."""
        return int(self.bit_offsets[-1])

    def nbytes(self) -> int:
        """Bytes held: payload + bit offsets + fallback flags (codebook excluded: shared)."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.payload, self.bit_offsets, self.raw_fallback)
        )



def _check_stream_sizes(raw: np.ndarray, size: np.ndarray, n_symbols: int, bits: int) -> None:
    """A raw stream holds exactly ``n_symbols * bits`` bits; a coded one at least one bit per
    symbol and less than raw (the escape rule). raw (N,) bool, size (N,) int64 stream bits."""
    raw_size = n_symbols * bits
    bad_raw = np.flatnonzero(raw & (size != raw_size))
    if bad_raw.size:
        i = int(bad_raw[0])
        raise HuffmanError(
            f"corrupt block: stream {i} is flagged raw but holds {int(size[i])} bits, not "
            f"n_symbols * bits = {raw_size}"
        )
    bad_coded = np.flatnonzero(~raw & ((size < n_symbols) | (size >= raw_size)))
    if bad_coded.size:
        i = int(bad_coded[0])
        raise HuffmanError(
            f"corrupt block: coded stream {i} holds {int(size[i])} bits; {n_symbols} code words "
            f"take at least {n_symbols} and the encoder codes only below the raw size {raw_size}"
        )

def _payload_words(total_bits: int) -> int:
    """Words for ``total_bits`` stream bits plus the zero guard word."""
    return (total_bits + _WORD_BITS - 1) // _WORD_BITS + 1


def encode_blocks(symbols: torch.Tensor, codebook: Codebook) -> EncodedBlocks:
    """Code each row of ``symbols`` as an independent stream (format in the module doc).

    Args:
        symbols: ``uint8 (N, L)``, values ``< 2**codebook.bits``; any strides, any device.
        codebook: the code to use; a stream whose coded length would be ``>= L * bits`` is
            stored raw instead, so no stream ever takes more than its raw size.

    Returns:
        :class:`EncodedBlocks` on ``symbols.device`` (computed on the CPU).
    """
    if not isinstance(codebook, Codebook):
        raise HuffmanError(f"codebook must be a Codebook, got {type(codebook).__name__}")
    _check_tensor(symbols, "symbols", torch.uint8, 2)
    b = codebook.bits
    x = _as_numpy(symbols).astype(np.int64)  # (N, L)
    n, L = x.shape
    if x.size and int(x.max()) >= 1 << b:
        raise HuffmanError(
            f"symbols hold {int(x.max())}, outside the codebook's {b}-bit alphabet "
            f"0..{(1 << b) - 1}"
        )
    lengths = _as_numpy(codebook.lengths).astype(np.int64)
    codes = _as_numpy(codebook.codes).astype(np.int64)

    lens = lengths[x]  # (N, L) code length per symbol
    raw = lens.sum(axis=1) >= L * b  # (N,) the escape: raw is no longer than coded
    lens = np.where(raw[:, None], b, lens)
    vals = np.where(raw[:, None], x, codes[x]).astype(np.uint64)  # (N, L)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens.sum(axis=1), out=off[1:])
    pos = (off[:-1, None] + np.cumsum(lens, axis=1) - lens).reshape(-1)  # (N*L,) start bits

    total = int(off[-1])
    n_words = _payload_words(total)
    w, s = pos >> 5, pos & 31
    # place each code word in the 64-bit window of words (w, w+1): s + len <= 31 + 16 < 64
    v64 = vals.reshape(-1) << (64 - s - lens.reshape(-1)).astype(np.uint64)
    hi, lo = v64 >> np.uint64(32), v64 & np.uint64(0xFFFFFFFF)
    # code words never overlap, so OR == sum; bincount sums in float64, exact here because
    # every partial sum is an integer < 2**32 < 2**53
    payload = np.bincount(
        np.concatenate([w, w + 1]),
        weights=np.concatenate([hi, lo]).astype(np.float64),
        minlength=n_words,
    ).astype(np.uint32)

    dev = symbols.device
    return EncodedBlocks(
        payload=torch.from_numpy(payload).to(dev),
        bit_offsets=torch.from_numpy(off).to(dev),
        raw_fallback=torch.from_numpy(raw).to(dev),
        n_symbols=L,
        bits=b,
    )


def decode_blocks(encoded: EncodedBlocks, codebook: Codebook) -> torch.Tensor:
    """Reference decoder: all streams in lockstep, one table lookup per symbol, ``L`` steps.

    Args:
        encoded: streams from :func:`encode_blocks` (structure validated on construction).
        codebook: the codebook they were encoded with.

    Returns:
        ``uint8 (N, L)`` symbols on ``encoded.payload.device``.

    Raises:
        HuffmanError: bits mismatch, or a stream runs past its end or ends with bits left over
            (corrupt offsets or payload, or a different codebook).
    """
    if not isinstance(encoded, EncodedBlocks):
        raise HuffmanError(f"encoded must be EncodedBlocks, got {type(encoded).__name__}")
    if not isinstance(codebook, Codebook):
        raise HuffmanError(f"codebook must be a Codebook, got {type(codebook).__name__}")
    if encoded.bits != codebook.bits:
        raise HuffmanError(
            f"blocks were encoded with {encoded.bits}-bit symbols but the codebook is "
            f"{codebook.bits}-bit"
        )
    off = encoded.bit_offsets
    return decode_bit_ranges(
        encoded.payload, off[:-1], off[1:], encoded.raw_fallback, encoded.n_symbols, codebook
    )


def decode_bit_ranges(
    payload: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    raw_fallback: torch.Tensor,
    n_symbols: int,
    codebook: Codebook,
) -> torch.Tensor:
    """Decode streams given by explicit bit ranges of a payload (the lockstep loop of the doc).

    :func:`decode_blocks` calls this with ``starts = off[:-1]``, ``ends = off[1:]``; layouts
    that store offsets differently (e.g. word-aligned chunks with per-stream lengths, see
    :mod:`kvcalib.methods.huffman`) compute ``starts``/``ends`` and call it directly.

    Args:
        payload: ``uint32 (W,)``, bits MSB-first as in the block format; its last word is read
            only as the guard of a 64-bit window, so every stream must end by bit ``32 * (W - 1)``.
        starts, ends: ``int64 (N,)``, stream ``i`` is bits ``[starts[i], ends[i])``. Streams need
            not be contiguous or ordered.
        raw_fallback: ``bool (N,)``, stream stored raw (``n_symbols * bits`` bits).
        n_symbols: ``L``, symbols per stream.
        codebook: the code the streams were written with.

    Returns:
        ``uint8 (N, L)`` on ``payload.device``.

    Raises:
        HuffmanError: bad dtypes/shapes, a range outside the payload, a size that contradicts
            its raw flag, or a stream that runs past its end or ends with bits left over. Every
            read stays inside the payload and the loop runs exactly ``L`` steps: corrupt input
            never hangs and never reads out of bounds.
    """
    if not isinstance(codebook, Codebook):
        raise HuffmanError(f"codebook must be a Codebook, got {type(codebook).__name__}")
    _check_tensor(payload, "payload", torch.uint32, 1)
    _check_tensor(starts, "starts", torch.int64, 1)
    _check_tensor(ends, "ends", torch.int64, 1)
    _check_tensor(raw_fallback, "raw_fallback", torch.bool, 1)
    L = n_symbols
    if isinstance(L, bool) or not isinstance(L, int) or L < 0:
        raise HuffmanError(f"n_symbols must be an int >= 0, got {L!r}")
    n = raw_fallback.numel()
    if starts.numel() != n or ends.numel() != n:
        raise HuffmanError(
            f"starts ({starts.numel()}), ends ({ends.numel()}) and raw_fallback ({n}) must have "
            f"one entry per stream"
        )
    b, M = codebook.bits, codebook.max_len
    payload_np = _as_numpy(payload).astype(np.uint64)  # (W,)
    start = _as_numpy(starts)  # (N,)
    end = _as_numpy(ends)  # (N,)
    raw = _as_numpy(raw_fallback)  # (N,)
    limit = _WORD_BITS * (payload_np.shape[0] - 1)  # last readable stream bit + 1 (guard word)
    size = end - start
    bad = np.flatnonzero((start < 0) | (size < 0) | (end > limit))
    if bad.size:
        i = int(bad[0])
        raise HuffmanError(
            f"corrupt block: stream {i} spans bits [{int(start[i])}, {int(end[i])}), outside "
            f"the payload's {max(limit, 0)} stream bits (W = {payload_np.shape[0]} words, the "
            f"last one a zero guard word)"
        )
    _check_stream_sizes(raw, size, L, b)
    table_sym, table_len = (_as_numpy(t) for t in codebook.decode_table())  # (2**M,) each
    table_len = table_len.astype(np.int64)

    pos = start.copy()  # (N,) next bit of each stream
    out = np.empty((n, L), dtype=np.uint8)
    mask = np.uint64((1 << M) - 1)
    for k in range(L):
        done = pos >= end  # reading here would leave the stream (and maybe the payload)
        if done.any():
            i = int(np.flatnonzero(done)[0])
            raise HuffmanError(
                f"corrupt block: stream {i} ends after {k} of {L} symbols "
                f"(bits [{int(start[i])}, {int(end[i])}))"
            )
        w, s = pos >> 5, pos & 31
        window = (payload_np[w] << np.uint64(32)) | payload_np[w + 1]  # (N,) 64-bit windows
        peek = ((window >> (64 - s - M).astype(np.uint64)) & mask).astype(np.int64)  # (N,)
        out[:, k] = np.where(raw, peek >> (M - b), table_sym[peek])
        pos += np.where(raw, b, table_len[peek])
        over = pos > end
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise HuffmanError(
                f"corrupt block: symbol {k} of stream {i} runs past the stream's end "
                f"(bit {int(pos[i])} > {int(end[i])})"
            )
    short = pos != end
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise HuffmanError(
            f"corrupt block: stream {i} has {int(end[i] - pos[i])} bits left after its {L} "
            f"symbols (bits [{int(start[i])}, {int(end[i])}))"
        )
    return torch.from_numpy(out).to(payload.device)


def encoded_bits_per_symbol(encoded: EncodedBlocks, include_overhead: bool = False) -> float:
    """Stream bits per symbol (``bit_offsets[-1] / (N * L)``), at most ``bits``.

    With ``include_overhead=True``: ``8 * nbytes() / (N * L)``, i.e. also the guard word,
    offsets and flags (the honest-memory figure; the codebook is still excluded).
    """
    count = encoded.n_streams * encoded.n_symbols
    if count == 0:
        raise HuffmanError("encoded_bits_per_symbol: the blocks hold no symbols")
    num = 8 * encoded.nbytes() if include_overhead else encoded.total_bits
    return num / count


# ----------------------------------------------------------------------------------------------
# the KV cache's stream layout (described in kvcalib.methods.huffman's module docstring): the
# coded storage tier (kvcalib.runtime.coded_tier) and the method's accounting share it


@dataclass(frozen=True)
class StreamLayout:
    """The knobs of the cache stream layout (:mod:`kvcalib.methods.huffman`'s module docstring)."""

    tokens_per_stream: int = 1
    chunk_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("tokens_per_stream", "chunk_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.chunk_tokens % self.tokens_per_stream:
            raise ValueError(f"chunk_tokens ({self.chunk_tokens}) must be a multiple of tokens_per_stream "
                             f"({self.tokens_per_stream})")

    def symbols_per_stream(self, head_dim: int) -> int:
        return self.tokens_per_stream * head_dim

    def overhead_bits(self, head_dim: int, bits: int) -> float:
        """Index and padding bits per symbol this layout adds to a side's payload: the stream
        length field, the 32-bit chunk word and 16 bits of mean padding per chunk."""
        excess = torch.empty((), dtype=self.excess_dtype(head_dim, bits)).element_size()
        return 8.0 * excess / self.symbols_per_stream(head_dim) + 48.0 / (self.chunk_tokens * head_dim)

    def excess_dtype(self, head_dim: int, bits: int) -> torch.dtype:
        """dtype of ``stream_excess``: the smallest holding ``L * (bits - 1)``."""
        top = self.symbols_per_stream(head_dim) * (bits - 1)
        if top <= 255:
            return torch.uint8
        if top <= 32767:
            return torch.int16
        return torch.int32


def _check_codes(codes: object) -> torch.Tensor:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() != 4:
        got = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise HuffmanError(f"codes must be unpacked uint8 (B, H, N, D), got {got}")
    return codes


def encode_side(codes: torch.Tensor, codebook: Codebook, tokens_per_stream: int = 1) -> EncodedBlocks:
    """Code one side's unpacked codes ``uint8 (B, H, N, D)`` as format-v1 streams of
    ``tokens_per_stream`` tokens each, in (b, h, stream) order (``N % tokens_per_stream == 0``)."""
    b, h, n, d = _check_codes(codes).shape
    if isinstance(tokens_per_stream, bool) or not isinstance(tokens_per_stream, int) or tokens_per_stream < 1:
        raise HuffmanError(f"tokens_per_stream must be a positive int, got {tokens_per_stream!r}")
    if n % tokens_per_stream:
        raise HuffmanError(f"N = {n} tokens do not split into streams of {tokens_per_stream} tokens")
    rows = codes.reshape(b * h * (n // tokens_per_stream), tokens_per_stream * d)  # copies if non-contiguous
    return encode_blocks(rows, codebook)


def decode_side(encoded: EncodedBlocks, codebook: Codebook, shape: tuple[int, int, int, int],
                tokens_per_stream: int = 1) -> torch.Tensor:
    """Inverse of :func:`encode_side`: ``uint8 shape`` = (B, H, N, D)."""
    b, h, n, d = shape
    if n % tokens_per_stream or encoded.n_streams != b * h * (n // tokens_per_stream) \
            or encoded.n_symbols != tokens_per_stream * d:
        raise HuffmanError(
            f"blocks of {encoded.n_streams} streams x {encoded.n_symbols} symbols do not hold a side of "
            f"shape {tuple(shape)} in streams of {tokens_per_stream} tokens"
        )
    return decode_blocks(encoded, codebook).reshape(b, h, n, d)


@dataclass(frozen=True, eq=False)
class CacheStreams:
    """One side of one layer in the cache stream layout (module docstring, points 1-5).

    Attributes:
        payload: ``uint32 (W,)`` word-aligned chunks, then a zero guard word.
        chunk_word: ``int32 (B, H, C)`` first word of each chunk.
        stream_excess: ``(B, H, S)`` stream length minus ``L`` (dtype from
            :meth:`StreamLayout.excess_dtype`); ``S = N / tokens_per_stream``.
        shape: ``(B, H, N, D)`` of the unpacked codes.
        bits: bits per raw symbol.
        layout: the :class:`StreamLayout`.

    Construction validates the structure and raises :class:`HuffmanError` if it is corrupt:
    excess out of range, a chunk starting outside the payload, chunks overlapping or out of order,
    the last chunk running into the guard word.
    """

    payload: torch.Tensor
    chunk_word: torch.Tensor
    stream_excess: torch.Tensor
    shape: tuple[int, int, int, int]
    bits: int
    layout: StreamLayout = field(default_factory=StreamLayout)

    def __post_init__(self) -> None:
        b, h, n, d = self.shape
        lay = self.layout
        if n % lay.tokens_per_stream:
            raise HuffmanError(f"N = {n} is not a multiple of tokens_per_stream = {lay.tokens_per_stream}")
        s = n // lay.tokens_per_stream
        c = math.ceil(n / lay.chunk_tokens)
        if not isinstance(self.payload, torch.Tensor) or self.payload.dtype != torch.uint32 or self.payload.dim() != 1:
            raise HuffmanError("payload must be a 1-D uint32 tensor")
        if self.payload.numel() < 1:
            raise HuffmanError("corrupt cache streams: the payload lacks its guard word")
        if self.chunk_word.dtype != torch.int32 or tuple(self.chunk_word.shape) != (b, h, c):
            raise HuffmanError(f"chunk_word must be int32 {(b, h, c)}, got {self.chunk_word.dtype} "
                               f"{tuple(self.chunk_word.shape)}")
        want = lay.excess_dtype(d, self.bits)
        if self.stream_excess.dtype != want or tuple(self.stream_excess.shape) != (b, h, s):
            raise HuffmanError(f"stream_excess must be {want} {(b, h, s)}, got {self.stream_excess.dtype} "
                               f"{tuple(self.stream_excess.shape)}")
        top = lay.symbols_per_stream(d) * (self.bits - 1)
        ex = self.stream_excess.long()
        if bool(((ex < 0) | (ex > top)).any()):
            raise HuffmanError(f"corrupt cache streams: a stream_excess lies outside 0..{top} "
                               f"(L * (bits - 1))")
        words = self.chunk_word.long().reshape(-1)  # (B*H*C,)
        w_all = self.payload.numel()
        if bool(((words < 0) | (words >= w_all)).any()):
            raise HuffmanError(f"corrupt cache streams: a chunk_word lies outside the payload's {w_all} words")
        if words.numel():
            bits_c = self._chunk_bits().reshape(-1)  # (B*H*C,)
            end_word = words + (bits_c + _WORD_BITS - 1) // _WORD_BITS  # one past each chunk's last word
            nxt = torch.cat([words[1:], torch.tensor([w_all - 1])])  # the guard word stays free
            if bool((end_word > nxt).any()):
                j = int(torch.nonzero(end_word > nxt)[0])
                raise HuffmanError(f"corrupt cache streams: chunk {j} (in (b, h, chunk) order) runs into the "
                                   "next chunk or the guard word (chunk_word out of order or stream_excess "
                                   "too large)")

    @property
    def n_symbols(self) -> int:
        """``L``, symbols per stream."""
        return self.layout.symbols_per_stream(self.shape[3])

    def _sizes(self) -> torch.Tensor:
        return self.stream_excess.long() + self.n_symbols  # (B, H, S) stream bits

    def _chunk_bits(self) -> torch.Tensor:
        """Bits of each chunk's streams ``int64 (B, H, C)``."""
        b, h, _, _ = self.shape
        spc = self.layout.chunk_tokens // self.layout.tokens_per_stream
        sizes = self._sizes()
        s = sizes.shape[-1]
        c = self.chunk_word.shape[-1]
        padded = torch.zeros(b, h, c * spc, dtype=torch.int64)
        padded[:, :, :s] = sizes
        return padded.reshape(b, h, c, spc).sum(-1)

    def raw_fallback(self) -> torch.Tensor:
        """``bool (B, H, S)``: streams stored raw (excess == L * (bits - 1))."""
        return self.stream_excess.long() == self.n_symbols * (self.bits - 1)

    def bit_ranges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Start and end bit ``int64 (B*H*S,)`` of every stream (module docstring, point 5)."""
        spc = self.layout.chunk_tokens // self.layout.tokens_per_stream
        sizes = self._sizes()  # (B, H, S)
        s = sizes.shape[-1]
        incl = sizes.cumsum(-1)
        excl = incl - sizes  # (B, H, S) exclusive prefix sum over the whole (b, h) row
        chunk = torch.arange(s) // spc  # (S,)
        first = chunk * spc  # first stream of each stream's chunk
        base = excl[:, :, first] if s else excl  # prefix at the chunk's first stream
        starts = _WORD_BITS * self.chunk_word.long()[:, :, chunk] + (excl - base)  # (B, H, S)
        return starts.reshape(-1), (starts + sizes).reshape(-1)

    def nbytes(self) -> dict[str, int]:
        """Bytes held, by part: ``payload`` (with padding and guard word), ``chunk_index``,
        ``stream_index``."""
        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()
        return {"payload": size(self.payload), "chunk_index": size(self.chunk_word),
                "stream_index": size(self.stream_excess)}

    def stream_bits(self) -> int:
        """Bits of all streams (no padding, no index)."""
        return int(self._sizes().sum())


def to_cache_streams(encoded: EncodedBlocks, shape: tuple[int, int, int, int],
                     layout: StreamLayout = StreamLayout()) -> CacheStreams:
    """Re-lay format-v1 streams from :func:`encode_side` as :class:`CacheStreams` (word-aligned
    chunks, 32-bit chunk word index, per-stream excess lengths)."""
    b, h, n, d = shape
    tps, spc = layout.tokens_per_stream, layout.chunk_tokens // layout.tokens_per_stream
    if n % tps or encoded.n_streams != b * h * (n // tps) or encoded.n_symbols != tps * d:
        raise HuffmanError(f"blocks of {encoded.n_streams} x {encoded.n_symbols} symbols are not a side of "
                           f"shape {tuple(shape)} in streams of {tps} tokens")
    s = n // tps
    c = math.ceil(n / layout.chunk_tokens)
    off = encoded.bit_offsets.cpu().numpy()  # (B*H*S + 1,)
    src = encoded.payload.cpu().numpy().astype(np.uint64)  # (W,)
    # first and one-past-last stream of every chunk, in (b, h, chunk) order
    row = np.arange(b * h)[:, None] * s  # (BH, 1)
    first = row + np.minimum(np.arange(c) * spc, s)[None, :]  # (BH, C)
    last = row + np.minimum((np.arange(c) + 1) * spc, s)[None, :]
    c_start, c_end = off[first].reshape(-1), off[last].reshape(-1)  # (BH*C,) chunk bit ranges
    c_bits = c_end - c_start
    c_words = (c_bits + _WORD_BITS - 1) // _WORD_BITS  # (BH*C,)
    dest = np.zeros(c_words.shape[0] + 1, dtype=np.int64)
    np.cumsum(c_words, out=dest[1:])
    total_words = int(dest[-1])
    if total_words >= 2**31 - 1:
        raise HuffmanError("one side's payload exceeds 2**31 words: chunk_word (int32) cannot index it")
    # every destination word j of chunk q reads 32 source bits from c_start[q] + 32 j
    q = np.repeat(np.arange(c_words.shape[0]), c_words)  # (total_words,)
    j = np.arange(total_words) - dest[q]
    p = c_start[q] + _WORD_BITS * j
    w, sh = p >> 5, (p & 31).astype(np.uint64)
    window = (src[w] << np.uint64(32)) | src[w + 1]  # w + 1 exists: p < total bits, guard word
    val = (window >> (np.uint64(32) - sh)) & np.uint64(0xFFFFFFFF)
    left = c_bits[q] - _WORD_BITS * j  # bits of the chunk still to copy
    keep = np.minimum(left, _WORD_BITS).astype(np.uint64)
    val &= ~((np.uint64(1) << (np.uint64(32) - keep)) - np.uint64(1)) & np.uint64(0xFFFFFFFF)
    payload = np.concatenate([val.astype(np.uint32), np.zeros(1, dtype=np.uint32)])
    excess = (np.diff(off) - tps * d).reshape(b, h, s)
    return CacheStreams(
        payload=torch.from_numpy(payload),
        chunk_word=torch.from_numpy(dest[:-1].astype(np.int32).reshape(b, h, c)),
        stream_excess=torch.from_numpy(excess).to(layout.excess_dtype(d, encoded.bits)),
        shape=(b, h, n, d), bits=encoded.bits, layout=layout,
    )


def encode_cache_streams(codes: torch.Tensor, codebook: Codebook,
                         layout: StreamLayout = StreamLayout()) -> CacheStreams:
    """Unpacked codes ``uint8 (B, H, N, D)`` -> :class:`CacheStreams`."""
    enc = encode_side(codes, codebook, layout.tokens_per_stream)
    return to_cache_streams(enc, tuple(codes.shape), layout)  # type: ignore[arg-type]


def decode_cache_streams(streams: CacheStreams, codebook: Codebook) -> torch.Tensor:
    """Reference decoder of the cache stream layout -> ``uint8 (B, H, N, D)``.

    Raises:
        HuffmanError: bits mismatch, or corrupt streams (see :func:`kvcalib.quant.huffman.decode_bit_ranges`).
    """
    if not isinstance(streams, CacheStreams):
        raise HuffmanError(f"streams must be CacheStreams, got {type(streams).__name__}")
    if streams.bits != codebook.bits:
        raise HuffmanError(f"the streams hold {streams.bits}-bit symbols but the codebook is {codebook.bits}-bit")
    starts, ends = streams.bit_ranges()
    out = decode_bit_ranges(streams.payload, starts, ends, streams.raw_fallback().reshape(-1),
                            streams.n_symbols, codebook)
    return out.reshape(streams.shape)
