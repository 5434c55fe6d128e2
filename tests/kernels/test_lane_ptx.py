"""The all-plane lane unpack's PTX (``kvcalib_kernels.decode.unpack._lanes_all_asm``) computes, for every plane,
what the Triton-ops lanes (``unpack=6``, the CPU specification) compute: float16 bits of
``1024 + code * 2**shift`` for bytes (0, 2, 1, 3) of each 4.

The GPU runs the PTX (checked there against unpack 6 by ``_lanes_mismatch``); here its four
instructions (``mov``, ``prmt``, ``lop3``, ``and``) are interpreted in Python on random words, so a wrong
selector or mask fails on CPU too.
"""

from __future__ import annotations

import random
import re

import pytest

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, (unpack,) = kernel_modules("kvcalib_kernels.decode.unpack")


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX ``prmt.b32`` default mode: byte i of the result is byte ``sel[i]`` of {b, a} (a = 0..3)."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(pool[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: bit i of the result is bit ``4 a_i + 2 b_i + c_i`` of the lookup table."""
    out = 0
    for k in range(8):
        if (lut >> k) & 1:
            out |= (a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c)
    return out & 0xFFFFFFFF


def _run_ptx(src: str, word: int, n_out: int, *more: int) -> list[int]:
    """Interpret the asm block: ``$n_out`` is the input word (``more``: the next inputs, ``$n_out + 1``
    ...), ``$0..`` the outputs."""
    regs = {f"${n_out + i}": w for i, w in enumerate((word, *more))}

    def val(tok: str) -> int:
        tok = tok.strip()
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    for ins in re.findall(r"(mov|prmt|lop3|and|or|shl|shr)\.b32 ([^;]+);", src):
        op, args = ins[0], [t.strip() for t in ins[1].split(",")]
        if op == "mov":
            regs[args[0]] = val(args[1])
        elif op == "prmt":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "lop3":
            regs[args[0]] = _lop3(val(args[1]), val(args[2]), val(args[3]), val(args[4]))
        elif op == "shl":
            regs[args[0]] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
        elif op == "shr":
            regs[args[0]] = val(args[1]) >> val(args[2])
        elif op == "or":
            regs[args[0]] = val(args[1]) | val(args[2])
        else:
            regs[args[0]] = val(args[1]) & val(args[2])
    return [regs[f"${i}"] for i in range(n_out)]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_all_plane_ptx_matches_lanes(bits):
    src = unpack._lanes_all_asm(bits)
    planes = 8 // bits
    rng = random.Random(bits)
    for _ in range(500):
        data = [rng.randrange(256) for _ in range(4)]
        word = sum(x << (8 * i) for i, x in enumerate(data))
        outs = _run_ptx(src, word, 2 * planes)
        for s in range(planes):
            shift = s * bits
            mask = ((1 << bits) - 1) << shift
            want = [0x6400 | (data[i] & mask) for i in (0, 2, 1, 3)]  # element k holds byte _perm4(k)
            got = [outs[2 * s] & 0xFFFF, outs[2 * s] >> 16, outs[2 * s + 1] & 0xFFFF, outs[2 * s + 1] >> 16]
            assert got == want, (bits, s, data, [hex(g) for g in got], [hex(w) for w in want])


@pytest.mark.parametrize("shift", [2, 1], ids=["aligned", "odd"])
def test_three_bit_ptx_matches_lanes(shift):
    """3-bit codes: low bytes (2-bit planes) and their aligned high bytes (bit 2s: plane s's high
    bit, :func:`unpack._high_tile`) give, per plane, ``1024 + (low + 4 * high) * 2**(2 s)``, the
    Triton-ops lanes of ``unpack._codes`` with HI, for bytes (0, 2, 1, 3) of each 4. ``odd`` (the
    second half of a key row read in halves, :func:`unpack._key_tiles`): plane s's high bit is bit
    2s + 1 of the high byte."""
    src = unpack._lanes_all3_asm(shift)
    rng = random.Random(3 + shift)
    for _ in range(500):
        low = [rng.randrange(256) for _ in range(4)]
        high = [rng.randrange(256) for _ in range(4)]  # every bit set at random: the others must be ignored
        outs = _run_ptx(src, sum(x << (8 * i) for i, x in enumerate(low)), 8,
                        sum(x << (8 * i) for i, x in enumerate(high)))
        for s in range(4):
            hb = 2 * s + 2 - shift  # the high bit's place in the high byte
            want = [0x6400 | (low[i] & (3 << 2 * s)) | (((high[i] >> hb) & 1) << (2 * s + 2)) for i in (0, 2, 1, 3)]
            got = [outs[2 * s] & 0xFFFF, outs[2 * s] >> 16, outs[2 * s + 1] & 0xFFFF, outs[2 * s + 1] >> 16]
            assert got == want, (s, low, high, [hex(g) for g in got], [hex(w) for w in want])


def test_three_bit_pair_ptx_matches_lanes():
    """3-bit value units with the high tile in two masked loads (:func:`unpack._unit_tiles` PAIR):
    ``$9`` the high bytes of the columns whose high bit is bit 2s (zero in the others), ``$10``
    those whose high bit is bit 2s + 1 (zero where ``$9`` is loaded): per plane the lanes of the
    aligned tile, whichever of the two a register's columns read."""
    src = unpack._lanes_all3_asm(2, True)
    rng = random.Random(7)
    for _ in range(1000):
        low = [rng.randrange(256) for _ in range(4)]
        high = [rng.randrange(256) for _ in range(4)]
        odd = rng.random() < 0.5  # the register's columns are in the second half (a register holds one row's)
        hw = sum(x << (8 * i) for i, x in enumerate(high))
        outs = _run_ptx(src, sum(x << (8 * i) for i, x in enumerate(low)), 8, 0 if odd else hw, hw if odd else 0)
        for s in range(4):
            hb = 2 * s + odd  # the high bit's place in the high byte
            want = [0x6400 | (low[i] & (3 << 2 * s)) | (((high[i] >> hb) & 1) << (2 * s + 2)) for i in (0, 2, 1, 3)]
            got = [outs[2 * s] & 0xFFFF, outs[2 * s] >> 16, outs[2 * s + 1] & 0xFFFF, outs[2 * s + 1] >> 16]
            assert got == want, (s, odd, low, high, [hex(g) for g in got], [hex(w) for w in want])
