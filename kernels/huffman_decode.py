"""Table-lookup Huffman decoder for KV-cache code streams: bit-exact with the reference codec.

The specification is :func:`kvcalib.quant.huffman.decode_blocks` (block format v1 in
:mod:`kvcalib.quant.huffman`; re-exported as
:func:`kvcalib_kernels.reference.huffman_decode_reference`): same symbols, and the same streams
refused as corrupt (tested with ``torch.equal``).

One lane per stream: program ``p`` decodes streams ``[p * BLOCK_S, (p + 1) * BLOCK_S)``, each
lane running the table lookups of its stream in order. What keeps one lookup cheap:

- Lane state in registers: three payload words ``(wa, wb, wc)`` = bits ``[32 w, 32 w + 96)`` of
  the bit string and the bit ``s`` (``0 <= s < 32``) in ``wa`` where the stream continues. The
  next 32 stream bits are ``(wa << s) | (wb >> (32 - s))``: one funnel shift (``shf.l.clamp``,
  inline PTX where :func:`funnel_shift_available`), else three shifts that never shift by 32
  (undefined in PTX and LLVM). A lookup consumes at most 16 bits, so ``s`` crosses into the next
  word at most once; then the words shift down and ``wc`` is refilled by a load predicated on
  the crossing (its latency overlaps the next table lookup).
- ``K`` symbols per lookup (``step``, 1, 2 or 4): the table is indexed by the next ``K * M``
  stream bits, ``M = max(b, longest code word)``. ``K`` code words of at most ``M`` bits always
  fit in ``K * M`` bits, so one lookup decodes exactly ``K`` symbols. ``M`` is the longest word
  of *this* codebook, not its ``max_len`` (a prefix code decodes the same from any window at least
  as long as its longest word): 2-bit codebooks have ``M <= 3``, so four symbols per lookup take
  a 4096-entry table; 4-bit ones (``M`` ~ 6-7) decode pairs or single symbols. :func:`choose_step`
  picks the largest ``K`` whose table has at most ``2**max_index_bits`` (default 4096) entries.
- Two tables per codebook with the same index: ``lengths`` (uint8, bits consumed: on the lane's
  dependency chain) and ``values`` (the ``K`` symbols, off the chain), packed little-endian as
  the kernel wants them: bytes (``kind="u8"``: a lookup yields the ``K`` output bytes as one
  ``K``-byte word, stored as is) or float16 (``kind="f16"``, the fused attention kernel: a lookup
  yields the ``K`` codes already as float16 -- no integer-to-float conversion per code).
- Raw (fallback) streams read their own region of the tables, indexed by the next ``K * b``
  bits: a raw lane differs only in a base offset and a shift amount fixed at its start, so coded
  and raw lanes run the same instructions (no divergence, no per-symbol select).

``NL`` lookups are gathered into a ``(BLOCK_S, NL)`` tile by ``tl.join`` (a lane's row stays in
its own registers) and stored as one contiguous ``NL * K``-byte row segment per lane: with a
row-only mask and an aligned chunk start this is a vector store, no layout conversion.

Performance (H200, ``benchmarks/huffman.py``: 2**28 codes of real quantizer output, one
stream per 128-code token): ~1.5 TB/s of decoded uint8 codes for 2-bit codebooks (4 codes per
lookup), ~0.8 TB/s for 4-bit ones (1-2 per lookup) -- 0.17 / 0.33 ms for the K side of a
Mistral-7B layer at batch 8 x 32k. Chunks of 64 codes per store matter (16: 3x slower).

Safety: every payload load is masked to the payload (``W`` words), so corrupt offsets or a
stream decoded with the wrong codebook can never read out of bounds; the trip count is fixed,
so nothing can hang. With ``validate=True`` (default) the launcher first checks the block
structure (one device sync: offsets start at 0, never decrease, end inside the payload; raw
flags agree with stream sizes) and the kernel reports every stream that does not end exactly at
its next offset -- exactly the streams :func:`~kvcalib.quant.huffman.decode_blocks` refuses
(each symbol consumes >= 1 bit, so "ends exactly at the next offset" implies never running past
it). A bit flip that keeps every stream aligned decodes to wrong symbols undetected (no checksum).

The ``@triton.jit`` helpers ``_dec_start`` / ``_dec_chunk`` are shared with the fused
decode-attention kernel (:mod:`kvcalib_kernels.decode_attention_huffman`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvcalib.quant.huffman import Codebook, EncodedBlocks, HuffmanError

__all__ = ["MAX_INDEX_BITS", "DecodeTable", "choose_step", "decode_streams", "decode_table", "funnel_shift_available",
           "huffman_decode", "validate_streams"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---------------------------------------------------------------- device helpers (shared)


@triton.jit
def _word(Payload, W, idx, live):
    """Payload word ``idx`` (int64) as uint32 where ``live``; 0 outside the payload's W words."""
    return tl.load(Payload + idx, mask=live & (idx < W), other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _dec_start(Payload, W, start, raw, coded_sh, raw_sh, raw_off):
    """Lane constants and state for streams starting at bit ``start`` (int64 (S,)).

    ``raw`` (S,) bool: stream stored raw. ``coded_sh`` / ``raw_sh``: 32 minus the index width of
    the coded / raw table region; ``raw_off``: first entry of the raw region. Returns
    ``(pw, lim, toff, sh, r, s, wa, wb, wc)``: ``pw`` pointer to the lane's first refill word
    (the word after ``wc``), ``lim`` words left in the payload from there (int32; refills at
    ``r >= lim`` read 0), the lane's table offset and shift, ``r`` words advanced so far,
    ``s`` the bit in ``wa``, and the three current words. A negative (corrupt) start is clamped
    to 0, so word indices never go below 0 and only the upper bound needs a mask.
    """
    start = tl.maximum(start, 0)
    w = start >> 5  # int64 word index of wa
    live = w >= 0  # always True: an all-true mask of the lanes' shape
    lim = tl.minimum(tl.maximum(W - (w + 3), -1), 2147483647).to(tl.int32)
    toff = tl.where(raw, raw_off, 0)
    sh = tl.where(raw, raw_sh, coded_sh)
    return (Payload + (w + 3), lim, toff, sh, tl.zeros_like(lim), (start & 31).to(tl.int32),
            _word(Payload, W, w, live), _word(Payload, W, w + 1, live), _word(Payload, W, w + 2, live))


@triton.jit
def _peek32(wa, wb, s, ASM: tl.constexpr):
    """The 32 stream bits from bit ``s`` of ``wa`` (0 <= s < 32): ``(wa << s) | (wb >> (32 - s))``.

    ASM: one funnel shift (``shf.l.clamp``); otherwise three shifts that never shift by 32
    (undefined in PTX and LLVM) -- LLVM does not turn them into a funnel shift by itself."""
    if ASM:
        return tl.inline_asm_elementwise("shf.l.clamp.b32 $0, $2, $1, $3;", "=r,r,r,r", [wa, wb, s],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    else:
        su = s.to(tl.uint32)
        return (wa << su) | ((wb >> 1) >> (31 - su))


@triton.jit
def _dec_step(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, live, GUARD: tl.constexpr, ASM: tl.constexpr):
    """One table lookup of every lane: returns the new state and the lookup's value (the K symbols
    packed as ValT's element type). ``live`` (scalar bool, used when GUARD): False past the
    stream's last lookup (tail of a chunk): the lane then keeps its position."""
    x = _peek32(wa, wb, s, ASM)
    idx = toff + (x >> sh.to(tl.uint32)).to(tl.int32)
    n = tl.load(LenT + idx).to(tl.int32)  # bits consumed: the only load on the lane's chain
    v = tl.load(ValT + idx)
    if GUARD:
        n = tl.where(live, n, 0)
    s = s + n
    adv = s >= 32  # at most one word per lookup: s < 32 and n <= 16
    s = tl.where(adv, s - 32, s)
    wa = tl.where(adv, wb, wa)
    wb = tl.where(adv, wc, wb)
    wc = tl.where(adv, tl.load(pw + r, mask=adv & (r < lim), other=0).to(tl.uint32, bitcast=True), wc)
    r = r + adv.to(tl.int32)
    return r, s, wa, wb, wc, v


@triton.jit
def _cat_cols(x, y):
    """(S, m) and (S, m) -> (S, 2 m) = [x | y]: join adds a minor dim (registers of the same lane),
    permute + reshape lay the two halves side by side; no data leaves the lane's registers."""
    j = tl.permute(tl.join(x, y), (0, 2, 1))  # (S, 2, m)
    return tl.reshape(j, (j.shape[0], j.shape[1] * j.shape[2]))


@triton.jit
def _dec2(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD: tl.constexpr, ASM: tl.constexpr):
    r, s, wa, wb, wc, y0 = _dec_step(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k < NW, GUARD, ASM)
    r, s, wa, wb, wc, y1 = _dec_step(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k + 1 < NW, GUARD, ASM)
    return r, s, wa, wb, wc, tl.join(y0, y1)  # (S, 2)


@triton.jit
def _dec4(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD: tl.constexpr, ASM: tl.constexpr):
    r, s, wa, wb, wc, t0 = _dec2(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    r, s, wa, wb, wc, t1 = _dec2(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k + 2, NW, GUARD, ASM)
    return r, s, wa, wb, wc, _cat_cols(t0, t1)


@triton.jit
def _dec8(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD: tl.constexpr, ASM: tl.constexpr):
    r, s, wa, wb, wc, t0 = _dec4(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    r, s, wa, wb, wc, t1 = _dec4(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k + 4, NW, GUARD, ASM)
    return r, s, wa, wb, wc, _cat_cols(t0, t1)


@triton.jit
def _dec16(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD: tl.constexpr, ASM: tl.constexpr):
    r, s, wa, wb, wc, t0 = _dec8(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    r, s, wa, wb, wc, t1 = _dec8(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k + 8, NW, GUARD, ASM)
    return r, s, wa, wb, wc, _cat_cols(t0, t1)


@triton.jit
def _dec32(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD: tl.constexpr, ASM: tl.constexpr):
    r, s, wa, wb, wc, t0 = _dec16(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    r, s, wa, wb, wc, t1 = _dec16(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k + 16, NW, GUARD, ASM)
    return r, s, wa, wb, wc, _cat_cols(t0, t1)


@triton.jit
def _dec_chunk(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, NL: tl.constexpr, GUARD: tl.constexpr,
               ASM: tl.constexpr):
    """Lookups ``k .. k + NL - 1`` of every lane as a ``(S, NL)`` tile of table values (row = lane),
    plus the new lane state; ``NW`` = lookups per stream (for GUARD). NL in {2, 4, 8, 16, 32}
    (static unroll: no loop-carried tile)."""
    if NL == 2:
        return _dec2(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    elif NL == 4:
        return _dec4(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    elif NL == 8:
        return _dec8(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    elif NL == 16:
        return _dec16(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)
    else:
        return _dec32(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k, NW, GUARD, ASM)


# ---------------------------------------------------------------- kernel


@triton.jit(do_not_specialize=["N", "W", "coded_sh", "raw_sh", "raw_off"])
def _huffman_decode_kernel(
    # the bit string: (W,) int32 view of the uint32 payload (guard word included)
    Payload, W,
    # stream i is bits [Offsets[i], Offsets[i+1]): (N+1,) int64; Raw (N,) uint8: stored raw
    Offsets, Raw, N,
    # tables (kind "u8", see DecodeTable): LenT uint8 bits per lookup; ValT the K symbols as one
    # K-byte word; coded entries [0, raw_off) indexed by the next 32 bits >> coded_sh, raw
    # entries from raw_off indexed by the next 32 bits >> raw_sh
    LenT, ValT, coded_sh, raw_sh, raw_off,
    # outputs: symbols as (N, NW) K-byte words (the (N, L) uint8 output viewed as uint8/int16/
    # int32), contiguous; Bad (N,) uint8 = stream i does not end at Offsets[i+1]
    Out, Bad, NW,
    ASM: tl.constexpr,  # funnel shift by inline PTX (probed: funnel_shift_available)
    NL: tl.constexpr,  # lookups per stored chunk (tile width)
    GUARD: tl.constexpr,  # NW % NL != 0: the last chunk has lanes past the stream's end
    BLOCK_S: tl.constexpr,  # streams (lanes) per program
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)  # (BLOCK_S,) stream ids
    ok = i < N
    start = tl.load(Offsets + i, mask=ok, other=0)
    end = tl.load(Offsets + i + 1, mask=ok, other=0)
    raw = tl.load(Raw + i, mask=ok, other=0) != 0
    pw, lim, toff, sh, r, s, wa, wb, wc = _dec_start(Payload, W, start, raw, coded_sh, raw_sh, raw_off)
    out_rows = Out + i * NW  # (BLOCK_S,) pointers
    cols = tl.arange(0, NL)
    for k0 in range(0, NW, NL):
        k0 = tl.multiple_of(k0, NL)  # the alignment the store vectorisation needs (not inferred for loop counters)
        r, s, wa, wb, wc, t = _dec_chunk(LenT, ValT, pw, lim, toff, sh, r, s, wa, wb, wc, k0, NW, NL, GUARD, ASM)
        if GUARD:
            tl.store(out_rows[:, None] + k0 + cols[None, :], t, mask=ok[:, None] & ((k0 + cols) < NW)[None, :])
        else:  # a row mask only: constant along the row, so each lane stores its chunk as one vector
            tl.store(out_rows[:, None] + k0 + cols[None, :], t, mask=ok[:, None])
    pos = (tl.maximum(start, 0) >> 5) * 32 + r.to(tl.int64) * 32 + s  # where each stream's symbols ended
    tl.store(Bad + i, (pos != end).to(tl.uint8), mask=ok)


@triton.jit
def _probe_funnel_kernel(A, B, S, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(A + offs).to(tl.uint32, bitcast=True)
    b = tl.load(B + offs).to(tl.uint32, bitcast=True)
    s = tl.load(S + offs)
    tl.store(Y + offs, _peek32(a, b, s, True).to(tl.int32, bitcast=True))


FUNNEL_ERROR: list[str] = []  # why funnel_shift_available() said False


@functools.lru_cache(maxsize=None)
def funnel_shift_available(device_index: int = 0) -> bool:
    """Whether the inline-PTX funnel shift compiles and is exact on this GPU (checked once per
    device on random words against the shift formula); False on CPU / in the interpreter."""
    if _interpreting() or not torch.cuda.is_available():
        FUNNEL_ERROR.append("no CUDA device (or the interpreter)")
        return False
    try:
        dev = torch.device("cuda", device_index)
        g = torch.Generator().manual_seed(0)
        a = torch.randint(-2**31, 2**31, (256,), generator=g, dtype=torch.int64)
        b = torch.randint(-2**31, 2**31, (256,), generator=g, dtype=torch.int64)
        s = torch.arange(256, dtype=torch.int32) % 32
        y = torch.empty(256, dtype=torch.int32, device=dev)
        _probe_funnel_kernel[(1,)](a.to(torch.int32).to(dev), b.to(torch.int32).to(dev), s.to(dev), y, N=256)
        au, bu = a & 0xFFFFFFFF, b & 0xFFFFFFFF
        want = ((au << s) | ((bu >> 1) >> (31 - s))) & 0xFFFFFFFF
        want = torch.where(want >= 2**31, want - 2**32, want).to(torch.int32)
        ok = torch.equal(y.cpu(), want)
        if not ok:
            FUNNEL_ERROR.append("wrong result")
        return ok
    except Exception as err:  # noqa: BLE001 - any compile/launch failure means "not available here"
        FUNNEL_ERROR.append(f"{type(err).__name__}: {err}"[:2000])
        return False


# ---------------------------------------------------------------- decode tables


MAX_INDEX_BITS = 12
"""Default largest table index (``K * M`` bits): 4096 coded entries, 5-36 KiB with the values --
an L1-resident size. 2-bit codebooks decode 4 symbols per lookup, 4-bit ones 2 when their
longest word has <= 6 bits."""

_VALUE_DTYPES = {("u8", 1): torch.uint8, ("u8", 2): torch.int16, ("u8", 4): torch.int32,
                 ("f16", 1): torch.int16, ("f16", 2): torch.int32, ("f16", 4): torch.int64}


@dataclass(frozen=True, eq=False)
class DecodeTable:
    """A codebook's device-side decode tables for ``step`` symbols per lookup (module doc).

    Attributes:
        lengths: ``uint8 (E,)`` bits consumed by a lookup.
        values: ``(E,)`` the ``step`` symbols of a lookup, little-endian: bytes (``kind="u8"``:
            uint8 / int16 / int32 for step 1 / 2 / 4) or float16 bit patterns (``kind="f16"``:
            int16 / int32 / int64).
        step: ``K``, symbols per lookup (1, 2 or 4).
        table_bits: ``M = max(bits, longest code length)``.
        coded_bits: ``K * M``: coded entries ``[0, 2**coded_bits)``.
        raw_bits: ``K * bits``: raw-stream entries ``[2**coded_bits, E)``.
        bits: the codebook's ``b``.
        kind: ``"u8"`` or ``"f16"``.
    """

    lengths: torch.Tensor
    values: torch.Tensor
    step: int
    table_bits: int
    coded_bits: int
    raw_bits: int
    bits: int
    kind: str

    @property
    def raw_off(self) -> int:
        return 1 << self.coded_bits


def _table_bits(codebook: Codebook) -> int:
    return max(codebook.bits, int(codebook.lengths.max()))


@functools.lru_cache(maxsize=64)
def _decode_table_cached(codebook: Codebook, device: torch.device, step: int, kind: str) -> DecodeTable:
    b, k = codebook.bits, step
    m = _table_bits(codebook)
    sym, length = codebook.decode_table()  # (2**max_len,) each
    idx = np.arange(1 << m, dtype=np.int64) << (codebook.max_len - m)  # same code word, shorter peek
    s1 = sym.numpy().astype(np.int64)[idx]  # (2**m,) symbol of an m-bit peek
    l1 = length.numpy().astype(np.int64)[idx]
    # coded region: k code words from a (k*m)-bit peek, one after the other
    x = np.arange(1 << (k * m), dtype=np.int64)
    pos = np.zeros_like(x)
    coded = []
    for j in range(k):
        sub = (x >> (k * m - pos - m)) & ((1 << m) - 1)  # the m bits after the first j words
        coded.append(s1[sub])
        pos = pos + l1[sub]
    coded_len = pos
    # raw region: k raw symbols of b bits from a (k*b)-bit peek
    xr = np.arange(1 << (k * b), dtype=np.int64)
    raw = [(xr >> ((k - 1 - j) * b)) & ((1 << b) - 1) for j in range(k)]
    lengths = np.concatenate([coded_len, np.full(xr.shape, k * b)]).astype(np.uint8)
    syms = [np.concatenate([c, r]) for c, r in zip(coded, raw)]  # k arrays (E,)
    if kind == "f16":
        syms = [s.astype(np.float16).view(np.uint16).astype(np.int64) for s in syms]
        width = 16
    else:
        width = 8
    val = np.zeros_like(syms[0])
    for j, sj in enumerate(syms):  # little-endian: symbol j in bits [j*width, (j+1)*width)
        val |= sj << (j * width)
    dt = _VALUE_DTYPES[(kind, k)]
    nbits = torch.iinfo(dt).bits
    if nbits < 64:
        val = np.where(val >= 1 << (nbits - 1), val - (1 << nbits), val)  # two's complement
    values = torch.from_numpy(val).to(dt)
    return DecodeTable(lengths=torch.from_numpy(lengths).to(device), values=values.to(device), step=k,
                       table_bits=m, coded_bits=k * m, raw_bits=k * b, bits=b, kind=kind)


def decode_table(codebook: Codebook, device: torch.device | str, *, step: int = 1, kind: str = "u8") -> DecodeTable:
    """The decode tables of ``codebook`` on ``device`` for ``step`` symbols per lookup (cached per
    codebook object, device, step and kind). ``step * M`` must be <= 16 and ``step * bits`` <= 32."""
    if not isinstance(codebook, Codebook):
        raise HuffmanError(f"codebook must be a Codebook, got {type(codebook).__name__}")
    if step not in (1, 2, 4) or kind not in ("u8", "f16"):
        raise ValueError(f"step must be 1, 2 or 4 and kind 'u8' or 'f16', got {step!r}, {kind!r}")
    if step * _table_bits(codebook) > 16:
        raise ValueError(f"{step} symbols per lookup of a codebook with {_table_bits(codebook)}-bit words need a "
                         f"{step * _table_bits(codebook)}-bit index; at most 16 are supported")
    return _decode_table_cached(codebook, torch.device(device), step, kind)


def choose_step(codebook: Codebook, n_symbols: int, max_index_bits: int = MAX_INDEX_BITS) -> int:
    """Symbols per lookup: the largest ``K`` in (4, 2, 1) dividing ``n_symbols`` whose table index
    ``K * M`` has at most ``max_index_bits`` bits (``K = 1`` always qualifies)."""
    m = _table_bits(codebook)
    for k in (4, 2):
        if n_symbols % k == 0 and k * m <= min(max_index_bits, 16):
            return k
    return 1


# ---------------------------------------------------------------- launcher


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors (got {t.device}); on CPU set TRITON_INTERPRET=1 before "
            f"importing kvcalib_kernels modules"
        )


def _check_block_tensors(payload, bit_offsets, raw_fallback, name: str = "") -> int:
    """Dtype/shape/contiguity/device checks of one block (no sync). Returns N."""
    p = f"{name}: " if name else ""
    for t, what, dts in ((payload, "payload", (torch.uint32, torch.int32)),
                         (bit_offsets, "bit_offsets", (torch.int64,)),
                         (raw_fallback, "raw_fallback", (torch.bool, torch.uint8))):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{p}{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dts or t.dim() != 1:
            raise ValueError(f"{p}{what} must be 1-D {' or '.join(map(str, dts))}, got {t.dtype} {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{p}{what} must be contiguous")
        if t.device != payload.device:
            raise ValueError(f"{p}{what} is on {t.device}, payload on {payload.device}")
    n = raw_fallback.numel()
    if bit_offsets.numel() != n + 1:
        raise ValueError(f"{p}bit_offsets must have N+1 = {n + 1} entries for {n} streams, got {bit_offsets.numel()}")
    if payload.numel() < 1:
        raise ValueError(f"{p}payload must hold at least the guard word")
    return n


def validate_streams(payload: torch.Tensor, bit_offsets: torch.Tensor, raw_fallback: torch.Tensor, *,
                     n_symbols: int, bits: int, name: str = "") -> None:
    """Structure checks of a block before a kernel reads it (one device sync).

    Raises :class:`~kvcalib.quant.huffman.HuffmanError` (a ValueError) when ``bit_offsets[0] != 0``,
    the offsets decrease, the last stream ends past the payload (guard word included), or a raw
    flag disagrees with its stream's size (raw: ``L * b`` bits; coded: ``L <= size < L * b``).
    These are the structure rules of :class:`~kvcalib.quant.huffman.EncodedBlocks`.
    """
    p = f"{name}: " if name else ""
    n = _check_block_tensors(payload, bit_offsets, raw_fallback, name)
    off = bit_offsets
    raw = raw_fallback.bool()
    size = off[1:] - off[:-1]  # (N,)
    lb = n_symbols * bits
    dec = size < 0
    bad_raw = raw & (size != lb)
    bad_coded = ~raw & ((size < n_symbols) | (size >= lb))
    words = payload.numel()

    def first(m: torch.Tensor) -> torch.Tensor:  # index of the first True, n if none (on the device)
        if not n:
            return torch.zeros((), dtype=torch.int64, device=m.device)
        return torch.where(m, torch.arange(n, device=m.device), n).min()

    stats = torch.stack([off[0], off[-1], first(dec), first(bad_raw), first(bad_coded)]).cpu().tolist()
    off0, last, i_dec, i_raw, i_coded = (int(x) for x in stats)
    if off0 != 0:
        raise HuffmanError(f"{p}corrupt block: bit_offsets[0] must be 0, got {off0}")
    if i_dec < n:
        o = bit_offsets[i_dec:i_dec + 2].cpu().tolist()
        raise HuffmanError(f"{p}corrupt block: bit_offsets decrease at stream {i_dec} ({o[0]} -> {o[1]}); "
                           f"they must be non-decreasing")
    need = (last + 31) // 32 + 1
    if words < need:
        raise HuffmanError(f"{p}corrupt block: streams end at bit {last}, which needs a payload of {need} uint32 "
                           f"words (with the guard word), got {words} (truncated payload or offsets past its end)")
    if i_raw < n:
        raise HuffmanError(f"{p}corrupt block: stream {i_raw} is flagged raw but does not hold n_symbols * bits = "
                           f"{lb} bits")
    if i_coded < n:
        raise HuffmanError(f"{p}corrupt block: coded stream {i_coded} holds a size outside [{n_symbols}, {lb}) bits")


def decode_streams(payload: torch.Tensor, bit_offsets: torch.Tensor, raw_fallback: torch.Tensor,
                   table: DecodeTable, *, n_symbols: int, validate: bool = True, block_s: int = 128,
                   chunk: int = 64, num_warps: int = 4, asm: bool | None = None) -> torch.Tensor:
    """Launcher: decode ``N`` streams of ``n_symbols`` symbols each.

    Args:
        payload: ``uint32 (W,)`` (or its ``int32`` view), contiguous: the bit string + guard word.
        bit_offsets: ``int64 (N+1,)`` contiguous stream boundaries.
        raw_fallback: ``bool (N,)`` (or ``uint8``) contiguous: stream stored raw.
        table: :func:`decode_table` of the codebook (``kind="u8"``), on the payload's device;
            its ``step`` must divide ``n_symbols``.
        n_symbols: ``L``.
        validate: check the structure first and refuse streams that do not end at their offsets
            (two device syncs); without it, corrupt input decodes to unspecified symbols (never
            an out-of-bounds read).
        block_s, chunk, num_warps: streams per program, symbols per stored chunk (a power of two;
            fewer for short streams), warps (tuning).
        asm: funnel shift by inline PTX; None = where :func:`funnel_shift_available`.

    Returns:
        ``uint8 (N, L)`` contiguous on the payload's device.
    """
    n = _check_block_tensors(payload, bit_offsets, raw_fallback)
    _check_device(payload)
    if isinstance(n_symbols, bool) or not isinstance(n_symbols, int) or n_symbols < 0:
        raise ValueError(f"n_symbols must be an int >= 0, got {n_symbols!r}")
    if not isinstance(table, DecodeTable) or table.kind != "u8" or table.values.device != payload.device:
        raise ValueError("table must be the DecodeTable (kind 'u8') of the codebook, on the payload's device "
                         "(decode_table())")
    if n_symbols % table.step:
        raise ValueError(f"a table of {table.step} symbols per lookup needs n_symbols divisible by it, got {n_symbols}")
    if block_s < 1 or block_s & (block_s - 1) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"block_s and chunk must be powers of two, got {block_s}, {chunk}")
    if validate:
        validate_streams(payload, bit_offsets, raw_fallback, n_symbols=n_symbols, bits=table.bits)
    L = n_symbols
    out = torch.empty((n, L), dtype=torch.uint8, device=payload.device)
    if n == 0 or L == 0:
        return out
    nw = L // table.step  # lookups (stored words) per stream
    nl = min(32, max(2, chunk // table.step), max(2, triton.next_power_of_2(nw)))
    if asm is None:
        asm = payload.device.type == "cuda" and funnel_shift_available(payload.device.index or 0)
    bad = torch.empty(n, dtype=torch.uint8, device=payload.device)
    pl = payload.view(torch.int32)
    raw = raw_fallback.view(torch.uint8) if raw_fallback.dtype == torch.bool else raw_fallback
    out_words = out.view(table.values.dtype)  # (N, L / step): a lookup stores its step bytes as one word
    _huffman_decode_kernel[(triton.cdiv(n, block_s),)](
        pl, pl.numel(), bit_offsets, raw, n,
        table.lengths, table.values, 32 - table.coded_bits, 32 - table.raw_bits, table.raw_off,
        out_words, bad, nw,
        ASM=bool(asm), NL=nl, GUARD=nw % nl != 0, BLOCK_S=block_s, num_warps=num_warps)
    if validate:
        idx = torch.nonzero(bad)
        if idx.numel():
            i = int(idx[0, 0])
            o = bit_offsets[i:i + 2].cpu().tolist()
            raise HuffmanError(
                f"corrupt block: stream {i} does not decode to exactly {L} symbols in its bits [{o[0]}, {o[1]}) "
                f"({idx.shape[0]} such streams): corrupt offsets or payload, or a different codebook")
    return out


# ---------------------------------------------------------------- public function


def huffman_decode(encoded: EncodedBlocks, codebook: Codebook, *, validate: bool = True) -> torch.Tensor:
    """Decode every stream of ``encoded`` with ``codebook``: ``uint8 (N, L)``, bit-exact with
    :func:`kvcalib.quant.huffman.decode_blocks` (which raises on the same corrupt streams).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``. ``validate=False``
    skips the two device syncs (CUDA-graph friendly) and the corruption checks.
    """
    if not isinstance(encoded, EncodedBlocks):
        raise HuffmanError(f"encoded must be EncodedBlocks, got {type(encoded).__name__}")
    if not isinstance(codebook, Codebook):
        raise HuffmanError(f"codebook must be a Codebook, got {type(codebook).__name__}")
    if encoded.bits != codebook.bits:
        raise HuffmanError(f"blocks were encoded with {encoded.bits}-bit symbols but the codebook is "
                           f"{codebook.bits}-bit")
    table = decode_table(codebook, encoded.payload.device, step=choose_step(codebook, encoded.n_symbols))
    return decode_streams(encoded.payload, encoded.bit_offsets, encoded.raw_fallback, table,
                          n_symbols=encoded.n_symbols, validate=validate)
