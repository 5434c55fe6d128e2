"""Packed codes -> float16 operands of the decode kernel's products (device helpers).

Codes become float16 without int->float conversions (which run at a quarter of the integer
rate). The kernel's default on GPU, ``unpack=5`` ("lanes", checked once per layout on the device
against ``unpack=6``): the 32-bit register of 4 packed bytes holds bytes 0 and 2 in its two 16-bit
lanes (1 and 3 after one shift or ``prmt``), the code bits stay in place and the float16 exponent
of 1024 is set around them, so a lane reads exactly ``1024 + code * 2**shift``; the 1024 and the
``2**shift`` are folded into the key bias / query planes and into the value accumulators by the
split kernel, and the lane order (bytes 0, 2, 1, 3) is undone on the query channels (keys) or on
the loaded value rows. ``unpack=6`` is the same arithmetic in Triton ops (the interpreter's
default and the fallback). 3-bit codes (:mod:`kvcalib.quant.packing`: a 2-bit planar part, then a 1-bit planar part of the high
bits) arrive as a 2-bit tile plus its high tile (:func:`_high_tile`, aligned column for column), and
every helper here takes that pair with ``HI``: plane s reads ``low + 4 * high`` (``1024 + (low + 4 *
high) * 2**(2 s)`` in the lanes: at most ``1024 + 7 * 64``, still exact), so the kernel folds and
multiplies them exactly as 2-bit planes. (3-bit folded keys from head_dim 128 read their rows in
halves instead, :func:`_key_tiles`, and 3-bit value units of head_dim 128 take the high tile in two
loads masked by column, :func:`_unit_tiles`: no column-dependent select between the loads and the products.) Sides that dequantize per element (per-token keys, value groups
narrower than a quarter of the head) take the plain codes: ``unpack=2`` (a few PTX instructions
per 4 codes) on GPU, ``1`` (the magic-number trick in Triton ops) elsewhere; float32 queries
take ``0`` (``.to``: exact float32 codes for IEEE products).
"""

from __future__ import annotations

import triton
import triton.language as tl


def _bytes_asm(bits: int, shift: int) -> str:
    """PTX for :func:`_unpack_asm`: ``prmt`` spreads bytes 0,1 (2,3) of the 32-bit word into the two
    16-bit lanes of one register, AND keeps the code bits, OR sets the float16 exponent of 1024
    (0x6400: the lane reads as 1024 + code exactly), ``sub.f16x2`` removes the 1024."""
    first = "mov.b32 r_t, $2;" if shift == 0 else f"shr.b32 r_t, $2, {shift};"
    body = ("{ .reg .b32 r_t, r_a, r_b, r_z, r_k; " + first + " mov.b32 r_z, 0; "
            "prmt.b32 r_a, r_t, r_z, 0x4140; prmt.b32 r_b, r_t, r_z, 0x4342; ")
    if bits < 8:
        m = (1 << bits) - 1
        body += f"and.b32 r_a, r_a, 0x{m:04X}{m:04X}; and.b32 r_b, r_b, 0x{m:04X}{m:04X}; "
    return body + ("or.b32 r_a, r_a, 0x64006400; or.b32 r_b, r_b, 0x64006400; mov.b32 r_k, 0x64006400; "
                   "sub.f16x2 $0, r_a, r_k; sub.f16x2 $1, r_b, r_k; }")


_BYTES_2_0 = tl.constexpr(_bytes_asm(2, 0))
_BYTES_2_2 = tl.constexpr(_bytes_asm(2, 2))
_BYTES_2_4 = tl.constexpr(_bytes_asm(2, 4))
_BYTES_2_6 = tl.constexpr(_bytes_asm(2, 6))
_BYTES_4_0 = tl.constexpr(_bytes_asm(4, 0))
_BYTES_4_4 = tl.constexpr(_bytes_asm(4, 4))
_BYTES_8_0 = tl.constexpr(_bytes_asm(8, 0))


@triton.jit
def _unpack_asm(x, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """uint8 tile -> float16 codes ``(x >> SHIFT) & (2**BITS - 1)``, 4 bytes per asm call
    (``unpack=2``; :func:`_bytes_asm`). Shift and mask are literals, hence one branch per (BITS, SHIFT)."""
    if BITS == 2:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(_BYTES_2_0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 2:
            return tl.inline_asm_elementwise(_BYTES_2_2, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 4:
            return tl.inline_asm_elementwise(_BYTES_2_4, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_BYTES_2_6, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    elif BITS == 4:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(_BYTES_4_0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_BYTES_4_4, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_BYTES_8_0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


def _lanes_all_asm(bits: int) -> str:
    """PTX for :func:`_code_planes` (unpack 5): every plane of 4 packed bytes in one block.

    The even bytes b0, b2 already sit in the low bits of the word's two 16-bit lanes, so each of
    their planes is one ``lop3`` ``(x & mask) | 0x64006400`` (code bits kept in place, the float16
    exponent of 1024 set around them); the odd bytes b1, b3 are moved down by one ``prmt`` that
    also writes the exponent bytes, (b1, 0x64, b3, 0x64), and each of their planes is one AND
    with an immediate (its code bits plus the exponent bits). One constant register for both
    (its bytes 0x00, 0x64 are the prmt's fill). 1 + 2 * planes instructions per 4 bytes; the form
    before built the even pair with a second ``prmt`` too (2 + 2 * planes: 2-bit 10 -> 9, 4-bit 6
    -> 5). (A per-plane ``(x & mask) | 0x6400`` with a constant per plane had ptxas rematerialize
    that constant before every use, ~130 register moves per block at batch 8 / 32k.)
    """
    src = 2 * (8 // bits)
    if bits == 8:  # one plane: the prmt's (b1, 0x64, b3, 0x64) is the odd lanes as they stand
        return ("{ .reg .b32 r_c; mov.b32 r_c, 0x64006400; "
                f"lop3.b32 $0, ${src}, 0x00FF00FF, r_c, 0xEA; prmt.b32 $1, ${src}, r_c, 0x7351; }}")
    body = ("{ .reg .b32 r_h, r_c; mov.b32 r_c, 0x64006400; "
            f"prmt.b32 r_h, ${src}, r_c, 0x7351; ")
    for s in range(8 // bits):
        m = ((1 << bits) - 1) << (s * bits)
        body += (f"lop3.b32 ${2 * s}, ${src}, 0x{m:04X}{m:04X}, r_c, 0xEA; "
                 f"and.b32 ${2 * s + 1}, r_h, 0x{m | 0x6400:04X}{m | 0x6400:04X}; ")
    return body + "}"


_LANES_ALL_2 = tl.constexpr(_lanes_all_asm(2))
_LANES_ALL_4 = tl.constexpr(_lanes_all_asm(4))
_LANES_ALL_8 = tl.constexpr(_lanes_all_asm(8))


def _lanes_all3_asm(shift: int = 2, pair: bool = False) -> str:
    """PTX of :func:`_lanes_all_asm` (2-bit planes) for 3-bit codes, on int16 units (2 a register,
    :func:`_unit_planes`): inputs ``$8`` the 4 low bytes and ``$9`` the 4 aligned high bytes (:func:`_high_tile`: bit 2s of high byte k is the high bit of
    plane s of low byte k). Each plane's lanes are the 2-bit lanes with the high bit ORed in two
    places up, ``(high & 1 << 2s) << 2``: one ``shl`` of each of the even and the odd high bytes
    (moved down by the same ``prmt`` as the low ones; the exponent bytes it writes land above the
    plane masks) and one ``lop3`` per lane register: 4 + 4 * 4 instructions per 4 bytes
    (2-bit: 1 + 4 * 2). ``shift`` 1: the high bit of plane s is bit 2s + 1 of high byte k (the
    second half of a key row read in halves, :func:`_key_tiles`), moved one place up to the same
    bit 2s + 2 (the bit below it lands on 2s + 1, outside the mask; so do the exponent bits a
    shift carries across lanes, into bits 0..1 of the next lane). ``pair`` (value units read with
    :func:`_unit_tiles` PAIR): ``$9`` holds the high units of the rows whose high bit is bit 2s and
    ``$10`` those of the rows whose high bit is bit 2s + 1 (each zero where the other is loaded):
    ``$9 | $10 >> 1`` is the aligned high word (the bits a shift moves across bytes land on bit 7,
    which no plane reads), 2 more instructions per 4 bytes."""
    hw = "r_x" if pair else "$9"
    body = ("{ .reg .b32 r_h, r_c, r_e, r_g, r_t" + (", r_x" if pair else "") + "; mov.b32 r_c, 0x64006400; "
            + ("shr.b32 r_x, $10, 1; or.b32 r_x, r_x, $9; " if pair else "")
            + f"prmt.b32 r_h, $8, r_c, 0x7351; shl.b32 r_e, {hw}, {shift}; prmt.b32 r_g, {hw}, r_c, 0x7351; "
            f"shl.b32 r_g, r_g, {shift}; ")
    for s in range(4):
        m = 3 << (2 * s)  # the plane's low bits in each 16-bit lane
        hb = 1 << (2 * s + 2)  # its high bit, two places above them
        body += (f"lop3.b32 r_t, $8, 0x{m:04X}{m:04X}, r_c, 0xEA; "
                 f"lop3.b32 ${2 * s}, r_e, 0x{hb:04X}{hb:04X}, r_t, 0xEA; "
                 f"and.b32 r_t, r_h, 0x{m | 0x6400:04X}{m | 0x6400:04X}; "
                 f"lop3.b32 ${2 * s + 1}, r_g, 0x{hb:04X}{hb:04X}, r_t, 0xEA; ")
    return body + "}"


_LANES_ALL_3 = tl.constexpr(_lanes_all3_asm())
_LANES_ALL_3_ODD = tl.constexpr(_lanes_all3_asm(1))  # high bit 2s + 1 (a key row's second half)
_LANES_ALL_3_PAIR = tl.constexpr(_lanes_all3_asm(2, True))  # value units' high tile in two masked loads


@triton.jit
def _high_tile(rows, row_ok, P: tl.constexpr, T: tl.constexpr):
    """The high bits of 3-bit codes aligned with their low tile (:func:`_code_tile`). A token's row
    holds ``P`` low units (bytes, or int16 units of two bytes), the 2-bit planar part, then ``P / 2``
    units of the 1-bit planar high part, whose bits (2s, 2s + 1) of unit j are the high bits of
    plane s's columns j and j + P / 2 (:mod:`kvcalib.quant.packing`). ``rows`` (N,) pointers to each
    token's first unit, ``row_ok`` (N,) its mask. Returns (N, P) (T: (P, N)) whose column j is high
    unit ``j mod P/2``, shifted right by one for j >= P / 2, so that its bit 2s (in each byte) is the
    high bit of the code in bits (2s, 2s + 1) of low unit j. Each high unit is loaded for two
    columns (an L1 hit the second time). (The (N, P / 2) units loaded once and joined with
    themselves shifted (tl.join, permute, reshape) were right in the interpreter and in a small
    kernel, and wrong inside the split kernel on an H200: artifacts/bench/HISTORY.md.)"""
    HALF: tl.constexpr = P // 2
    offs = tl.arange(0, P)
    high = P + offs % HALF  # (P,) each column's high unit
    # (one return: triton merges the types of every return of a function, taken or not; an int16
    # unit's arithmetic shift copies its sign into bit 15, which no plane reads)
    if T:
        h = tl.load(rows[None, :] + high[:, None], mask=row_ok[None, :], other=0)  # (P, N)
        out = tl.where((offs >= HALF)[:, None], h >> 1, h)
    else:
        h = tl.load(rows[:, None] + high[None, :], mask=row_ok[:, None], other=0)  # (N, P)
        out = tl.where((offs >= HALF)[None, :], h >> 1, h)
    return out


@triton.jit
def _code_tile(rows, row_ok, P: tl.constexpr, HI: tl.constexpr, T: tl.constexpr = False):
    """The (N, P) code units (uint8 bytes or int16 units) of the tokens whose first unit ``rows``
    (N,) points at, masked by ``row_ok`` (N,) (T: loaded transposed, (P, N)), and with HI (3-bit
    codes) their aligned high tile (:func:`_high_tile`; without HI the code tile again, unused)."""
    offs = tl.arange(0, P)
    if T:
        lo = tl.load(rows[None, :] + offs[:, None], mask=row_ok[None, :], other=0)
    else:
        lo = tl.load(rows[:, None] + offs[None, :], mask=row_ok[:, None], other=0)
    hi = lo
    if HI:
        hi = _high_tile(rows, row_ok, P, T)
    return lo, hi


@triton.jit
def _unit_tiles(rows, row_ok, P: tl.constexpr, HI: tl.constexpr, T: tl.constexpr, PAIR: tl.constexpr):
    """Value unit tiles (lo, hi, hi_b): :func:`_code_tile` (lo, hi, hi), or PAIR (3-bit codes) the
    high units in two loads at the same offsets as :func:`_high_tile`'s, masked by column: hi the
    columns j < P / 2 (whose high bit is bit 2s of high unit j), hi_b the others (bit 2s + 1 of
    unit j - P / 2), each 0 where the other is loaded; ``hi | hi_b >> 1`` is the aligned tile
    (:func:`_unit_planes` with PAIR). The column-dependent part is the loads' masks, not an op
    between the loads and the products: the select sent the 8 value plane tiles through shared
    memory, the masks keep the MMA operand layout (artifacts/bench/three_bit_sass.md)."""
    if PAIR:
        HALF: tl.constexpr = P // 2
        offs = tl.arange(0, P)
        high = P + offs % HALF
        if T:
            lo = tl.load(rows[None, :] + offs[:, None], mask=row_ok[None, :], other=0)  # (P, N)
            hi = tl.load(rows[None, :] + high[:, None], mask=row_ok[None, :] & (offs < HALF)[:, None], other=0)
            hi_b = tl.load(rows[None, :] + high[:, None], mask=row_ok[None, :] & (offs >= HALF)[:, None], other=0)
        else:
            lo = tl.load(rows[:, None] + offs[None, :], mask=row_ok[:, None], other=0)  # (N, P)
            hi = tl.load(rows[:, None] + high[None, :], mask=row_ok[:, None] & (offs < HALF)[None, :], other=0)
            hi_b = tl.load(rows[:, None] + high[None, :], mask=row_ok[:, None] & (offs >= HALF)[None, :], other=0)
    else:
        lo, hi = _code_tile(rows, row_ok, P, HI, T)
        hi_b = hi
    return lo, hi, hi_b


@triton.jit
def _key_tiles(rows, row_ok, P: tl.constexpr, HI: tl.constexpr, HSPLIT: tl.constexpr):
    """A block's key code tiles: (lo, lo, hi) of :func:`_code_tile` (N, P), or HSPLIT (3-bit codes
    read in halves, P / 2 >= 16): (lo_a, lo_b, h) (N, P / 2) each -- low units [0, P / 2) and
    [P / 2, P) and the P / 2 high units [P, 3 P / 2), each loaded once and contiguous (no
    :func:`_high_tile` gather and select): bit 2s of high unit j is the high bit of plane s's
    column j (half a), bit 2s + 1 that of column j + P / 2 (half b; :func:`_code_planes` with
    ODD). The halves multiply their own halves of the folded query planes (K = P / 2 products),
    and with no column-dependent op between the loads and the products Triton keeps the MMA
    operand layout through the unpack (the select sent all four key plane tiles through shared
    memory: artifacts/bench/three_bit_sass.md)."""
    if HSPLIT:
        HALF: tl.constexpr = P // 2
        offs = tl.arange(0, HALF)
        lo = tl.load(rows[:, None] + offs[None, :], mask=row_ok[:, None], other=0)
        lo_b = tl.load(rows[:, None] + (HALF + offs)[None, :], mask=row_ok[:, None], other=0)
        hi = tl.load(rows[:, None] + (P + offs)[None, :], mask=row_ok[:, None], other=0)
    else:
        lo, hi = _code_tile(rows, row_ok, P, HI)
        lo_b = lo
    return lo, lo_b, hi


@triton.jit
def _unit_lanes(u, SHIFT: tl.constexpr, BITS: tl.constexpr, h=None, HI: tl.constexpr = False):
    """uint16 units -> float16 ``1024 + (byte & (mask << SHIFT))`` of the low and of the high byte;
    HI (3-bit codes, h the uint16 high units of :func:`_high_tile`): plus the high bit
    ``(h_byte & 1 << SHIFT) << 2``."""
    M: tl.constexpr = ((1 << BITS) - 1) << SHIFT
    lo = (u & 0xFF) & M
    hi = (u >> 8) & M
    if HI:
        lo = lo | (((h & 0xFF) & (1 << SHIFT)) << 2)
        hi = hi | (((h >> 8) & (1 << SHIFT)) << 2)
    return (lo | 0x6400).to(tl.float16, bitcast=True), (hi | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _unit_planes(x, BITS: tl.constexpr, UNPACK: tl.constexpr, xh=None, HI: tl.constexpr = False, xh2=None,
                 PAIR: tl.constexpr = False):
    """All planes of an int16 tile of code units (N, P / 2), unit u = bytes 2u (low) and 2u + 1
    (high) of a token's code row, as float16 lanes ``1024 + (byte & (mask << s * BITS))``: 8 tiles
    (lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3), plane s of the low and of the high byte (tiles past
    8 // BITS repeat plane 0). Unlike the byte tiles of :func:`_code_planes`, this is elementwise
    (one unit in, one code of each plane out), so no register order is assumed: the value tile
    reaches the MMA through ``ldmatrix.trans`` of 16-bit units instead of byte loads and permutes.
    UNPACK 5: the PTX block of :func:`_lanes_all_asm` on 2 units per 32-bit register (its byte
    pairs (0, 2) and (1, 3) are then the low and the high bytes of the two units); 6: Triton ops.
    HI (3-bit codes, BITS 2): xh the aligned high units (:func:`_high_tile`), planes of 3 bits;
    PAIR: xh, xh2 the two masked high tiles of :func:`_unit_tiles` (aligned: ``xh | xh2 >> 1``)."""
    if UNPACK == 5:
        if HI and PAIR:
            l0, h0, l1, h1, l2, h2, l3, h3 = tl.inline_asm_elementwise(
                _LANES_ALL_3_PAIR, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [x, xh, xh2], dtype=(tl.float16,) * 8,
                is_pure=True, pack=2)
        elif HI:
            l0, h0, l1, h1, l2, h2, l3, h3 = tl.inline_asm_elementwise(
                _LANES_ALL_3, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [x, xh], dtype=(tl.float16,) * 8, is_pure=True,
                pack=2)
        elif BITS == 2:
            l0, h0, l1, h1, l2, h2, l3, h3 = tl.inline_asm_elementwise(
                _LANES_ALL_2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
        elif BITS == 4:
            l0, h0, l1, h1 = tl.inline_asm_elementwise(_LANES_ALL_4, "=r,=r,=r,=r,r", [x], dtype=(tl.float16,) * 4,
                                                       is_pure=True, pack=2)
            l2, h2, l3, h3 = l0, h0, l0, h0
        else:
            l0, h0 = tl.inline_asm_elementwise(_LANES_ALL_8, "=r,=r,r", [x], dtype=(tl.float16,) * 2, is_pure=True,
                                               pack=2)
            l1, h1, l2, h2, l3, h3 = l0, h0, l0, h0, l0, h0
    else:
        u = x.to(tl.uint16, bitcast=True)
        uh = u
        if HI:
            uh = xh.to(tl.uint16, bitcast=True)
            if PAIR:
                uh = uh | (xh2.to(tl.uint16, bitcast=True) >> 1)
        l0, h0 = _unit_lanes(u, 0, BITS, uh, HI)
        l1, h1, l2, h2, l3, h3 = l0, h0, l0, h0, l0, h0
        if BITS < 8:
            l1, h1 = _unit_lanes(u, BITS, BITS, uh, HI)
        if BITS < 4:
            l2, h2 = _unit_lanes(u, 2 * BITS, BITS, uh, HI)
            l3, h3 = _unit_lanes(u, 3 * BITS, BITS, uh, HI)
    return l0, h0, l1, h1, l2, h2, l3, h3


@triton.jit
def _code_planes(x, BITS: tl.constexpr, OUT_T: tl.constexpr, UNPACK: tl.constexpr, xh=None,
                 HI: tl.constexpr = False, ODD: tl.constexpr = False):
    """All planes of a uint8 byte tile (N, P): 4 tiles, plane s = :func:`_codes` (x, s * BITS)
    (tiles past 8 // BITS repeat plane 0). UNPACK 5 takes one PTX block for every plane
    (:func:`_lanes_all_asm`: values ``1024 + code * 2**shift``, element k of each 4 holding byte
    :func:`_perm4` (k)); other unpacks go plane by plane. HI (3-bit codes, BITS 2): xh the aligned
    high tile (:func:`_high_tile`), each plane ``low + 4 * high``; ODD: plane s's high bit is bit
    2s + 1 of xh instead of 2s (the second half of :func:`_key_tiles`' HSPLIT tiles)."""
    # (which 3-bit byte tiles take this PTX: kernels/decode/plan.py's three_bit_byte_unpack)
    if UNPACK == 5:
        if HI and ODD:  # bit 2s + 1 of the high bytes: the same block with the high shift 1
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _LANES_ALL_3_ODD, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [x, xh],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
            return c0, c1, c2, c3
        elif HI:  # _LANES_ALL_3 on 4 bytes a register: $8 the low bytes, $9 their aligned high bytes
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _LANES_ALL_3, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [x, xh],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
            return c0, c1, c2, c3
        elif BITS == 2:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                _LANES_ALL_2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
            return c0, c1, c2, c3
        elif BITS == 4:
            c0, c1 = tl.inline_asm_elementwise(_LANES_ALL_4, "=r,=r,=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=4)
            return c0, c1, c0, c0
        else:
            c0 = tl.inline_asm_elementwise(_LANES_ALL_8, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
            return c0, c0, c0, c0
    else:
        if HI and ODD:  # a uniform shift of the whole tile (no column-dependent op)
            xh = xh >> 1
        c0 = _codes(x, 0, BITS, OUT_T, UNPACK, xh, HI)
        c1 = c0
        c2 = c0
        c3 = c0
        if BITS < 8:
            c1 = _codes(x, BITS, BITS, OUT_T, UNPACK, xh, HI)
        if BITS < 4:
            c2 = _codes(x, 2 * BITS, BITS, OUT_T, UNPACK, xh, HI)
            c3 = _codes(x, 3 * BITS, BITS, OUT_T, UNPACK, xh, HI)
        return c0, c1, c2, c3


@triton.jit
def _perm4(k):
    """Swap positions 1 and 2 of every aligned group of 4 (an involution): the byte held by
    element k of each 4 of a lane-unpacked byte tile (:func:`_lanes_all_asm`: bytes 0, 2, 1, 3)."""
    return (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1)


@triton.jit
def _codes(x, SHIFT: tl.constexpr, BITS: tl.constexpr, OUT_T: tl.constexpr, UNPACK: tl.constexpr, xh=None,
           HI: tl.constexpr = False):
    """Codes of one plane of a uint8 byte tile (N, P), as exact ``OUT_T`` values (module doc).
    UNPACK 6 returns ``1024 + code * 2**SHIFT`` (folded by the caller), 0-2 the codes. (UNPACK 5
    only ever unpacks every plane at once: :func:`_code_planes`.) HI (3-bit codes, BITS 2): xh the
    aligned high tile (:func:`_high_tile`), the code ``low + 4 * high`` (unpack 2 takes Triton ops:
    its PTX reads one byte tile)."""
    if HI and (UNPACK == 6):  # 1024 + (low + 4 * high) * 2**SHIFT: the high bit two places above the low ones
        lanes = (x & (3 << SHIFT)).to(tl.uint16) | ((xh & (1 << SHIFT)).to(tl.uint16) << 2)
        return (lanes | 0x6400).to(tl.float16, bitcast=True)
    elif HI and (UNPACK == 0):
        return (((x >> SHIFT) & 3) | (((xh >> SHIFT) & 1) << 2)).to(OUT_T)  # codes 0..7
    elif HI:  # the magic-number conversion of unpack 1 (unpack 2's PTX reads one byte tile)
        c = ((x >> SHIFT) & 3) | (((xh >> SHIFT) & 1) << 2)  # uint8 codes 0..7
        return ((c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0).to(OUT_T)
    elif UNPACK == 6:
        # the values of unpack=5 in Triton ops (no lane swap): 1024 + code * 2**SHIFT, exact
        return ((x & (((1 << BITS) - 1) << SHIFT)).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    elif UNPACK == 2:
        return _unpack_asm(x, SHIFT, BITS).to(OUT_T)
    elif UNPACK == 1:
        c = (x >> SHIFT) & ((1 << BITS) - 1)  # uint8
        # float16 bits 0x6400 | c read as 1024 + c (exact); subtracting 1024 is exact too
        f = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        return f.to(OUT_T)
    else:
        c = (x >> SHIFT) & ((1 << BITS) - 1)
        return c.to(OUT_T)


@triton.jit
def _probe_bytes_kernel(X, Y, SHIFT: tl.constexpr, BITS: tl.constexpr, N: tl.constexpr, P: tl.constexpr):
    """Y (N, P) float16 = :func:`_unpack_asm` of X (N, P) uint8: the check of ``unpack=2`` on a device."""
    offs = tl.arange(0, N)[:, None] * P + tl.arange(0, P)[None, :]
    tl.store(Y + offs, _unpack_asm(tl.load(X + offs), SHIFT, BITS))
