"""Planar bit packing: exact layout and bit-exact round trips (atol = rtol = 0 by torch.equal)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcalib.quant.packing import (
    pack_2bit_u8,
    pack_4bit_u8,
    pack_8bit_u8,
    pack_codes,
    packed_width,
    unpack_2bit_u8,
    unpack_4bit_u8,
    unpack_8bit_u8,
    unpack_codes,
)

BITS = (2, 4, 8)
PACK = {2: pack_2bit_u8, 4: pack_4bit_u8, 8: pack_8bit_u8}
UNPACK = {2: unpack_2bit_u8, 4: unpack_4bit_u8, 8: unpack_8bit_u8}


def _random_codes(shape: tuple[int, ...], bits: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, shape, generator=gen, dtype=torch.uint8)


def _layout_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout written out as its formula, in int64: byte[p] = sum_s codes[p + s*P] << s*b."""
    per = 8 // bits
    width = codes.shape[-1] // per
    acc = torch.zeros((*codes.shape[:-1], width), dtype=torch.int64)  # (..., P)
    for s in range(per):
        acc += codes[..., s * width : (s + 1) * width].to(torch.int64) << (s * bits)
    assert acc.numel() == 0 or int(acc.max()) < 256
    return acc.to(torch.uint8)


# ------------------------------------------------------------------ exact layout, by hand


def test_2bit_layout_by_hand():
    codes = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0], dtype=torch.uint8)  # (L=8,), P = 2
    # byte0 = c0 | c2<<2 | c4<<4 | c6<<6 = 0 | 2<<2 | 3<<4 | 1<<6 = 0 + 8 + 48 + 64 = 120
    # byte1 = c1 | c3<<2 | c5<<4 | c7<<6 = 1 | 3<<2 | 2<<4 | 0<<6 = 1 + 12 + 32 + 0 = 45
    expected = torch.tensor([120, 45], dtype=torch.uint8)
    assert torch.equal(pack_2bit_u8(codes), expected)
    assert torch.equal(unpack_2bit_u8(expected), codes)


def test_4bit_layout_by_hand():
    codes = torch.tensor([[1, 2, 3, 15], [15, 0, 0, 7]], dtype=torch.uint8)  # (2, L=4), P = 2
    # row 0: byte0 = c0 | c2<<4 = 1 + 48 = 49; byte1 = c1 | c3<<4 = 2 + 240 = 242
    # row 1: byte0 = 15 | 0<<4 = 15;           byte1 = 0 | 7<<4 = 112
    expected = torch.tensor([[49, 242], [15, 112]], dtype=torch.uint8)
    assert torch.equal(pack_4bit_u8(codes), expected)
    assert torch.equal(unpack_4bit_u8(expected), codes)


def test_8bit_is_identity_copy():
    codes = torch.tensor([[0, 255, 7], [1, 2, 3]], dtype=torch.uint8)  # (2, 3)
    packed = pack_8bit_u8(codes)
    assert torch.equal(packed, codes)
    assert packed.data_ptr() != codes.data_ptr()  # a copy, not a view
    assert torch.equal(unpack_8bit_u8(packed), codes)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
def test_planes_are_recovered_by_shift_and_mask(bits):
    """What a kernel does: plane s of the (N, P) byte tile is (bytes >> s*b) & mask."""
    codes = _random_codes((5, 48), bits, seed=bits)  # (N, L)
    packed = pack_codes(codes, bits)  # (N, P)
    width = 48 // (8 // bits)
    for s in range(8 // bits):
        plane = (packed >> (s * bits)) & ((1 << bits) - 1)  # (N, P)
        assert torch.equal(plane, codes[:, s * width : (s + 1) * width])


# ------------------------------------------------------------------ round trips, property-based

_AWKWARD = [12, 36, 200, 8, 24, 40, 72, 120, 136]  # all multiples of 4 (so valid for every bits)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    length=st.one_of(st.sampled_from(_AWKWARD), st.integers(0, 40).map(lambda k: 4 * k)),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_and_layout_property(bits, lead, length, seed):
    codes = _random_codes((*lead, length), bits, seed)  # (..., L)
    packed = pack_codes(codes, bits)  # (..., P)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, packed_width(length, bits))
    assert packed.is_contiguous()
    assert torch.equal(packed, _layout_reference(codes, bits))
    assert torch.equal(PACK[bits](codes), packed)
    unpacked = unpack_codes(packed, bits)  # (..., L)
    assert unpacked.dtype == torch.uint8
    assert torch.equal(unpacked, codes)
    assert torch.equal(UNPACK[bits](packed), codes)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
def test_every_byte_value_round_trips(bits):
    """unpack is a bijection from bytes to code tuples: pack(unpack(b)) == b for all 256 bytes."""
    packed = torch.arange(256, dtype=torch.int64).to(torch.uint8).reshape(4, 64)  # (4, P=64)
    assert torch.equal(pack_codes(unpack_codes(packed, bits), bits), packed)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bit")
@pytest.mark.parametrize(
    "view",
    ["transpose", "step_slice", "offset_slice", "expand"],
)
def test_non_contiguous_inputs(bits, view):
    base = _random_codes((3, 40, 24), bits, seed=7)  # (3, 40, 24)
    if view == "transpose":
        codes = base.transpose(1, 2)  # (3, 24, 40), L = 40
    elif view == "step_slice":
        codes = base[:, :, ::2]  # (3, 40, 12), stride 2 on the packed axis
    elif view == "offset_slice":
        codes = base[1:, 3:, 4:]  # (2, 37, 20), storage offset
    else:
        codes = base[:1, :1, :].expand(5, 3, 24)  # (5, 3, 24), zero strides
    assert not codes.is_contiguous()
    before = codes.clone()
    packed = pack_codes(codes, bits)  # (..., P)
    assert packed.is_contiguous()
    assert torch.equal(packed, pack_codes(codes.contiguous(), bits))
    assert torch.equal(codes, before)  # input untouched
    # unpacking a non-contiguous packed view works too
    packed_t = pack_codes(base, bits).transpose(0, 1)  # (40, 3, P)
    assert torch.equal(unpack_codes(packed_t, bits), base.transpose(0, 1))


# ------------------------------------------------------------------ widths and errors


@pytest.mark.parametrize(
    ("length", "bits", "width"),
    [(0, 2, 0), (4, 2, 1), (200, 2, 50), (12, 4, 6), (36, 4, 18), (7, 8, 7), (128, 8, 128), (8, 3, 3), (64, 3, 24)],
)
def test_packed_width(length, bits, width):
    assert packed_width(length, bits) == width


@pytest.mark.parametrize(
    ("length", "bits"), [(6, 2), (3, 4), (5, 4), (4, 3), (12, 3), (8, 1), (8, 16), (-4, 2), (8, True)]
)
def test_packed_width_rejects(length, bits):
    with pytest.raises(ValueError):
        packed_width(length, bits)


def test_pack_rejects_bad_inputs():
    good = torch.zeros(2, 8, dtype=torch.uint8)  # (2, 8)
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(good.to(torch.int32), 4)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(good.float(), 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_codes(torch.zeros(2, 6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        pack_4bit_u8(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bits"):
        pack_codes(good, 5)
    with pytest.raises(ValueError, match="bits"):
        unpack_codes(good, 1)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        pack_2bit_u8(torch.full((8,), 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        pack_4bit_u8(torch.full((8,), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dimension"):
        pack_codes(torch.tensor(1, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="Tensor"):
        pack_codes([0, 1, 2, 3], 2)  # type: ignore[arg-type]


# ------------------------------------------------------------------ 3-bit: a 2-bit plane then a 1-bit plane


def test_3bit_layout_by_hand():
    from kvcalib.quant.packing import pack_3bit_u8, unpack_3bit_u8

    codes = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.uint8)  # (L=8,): low 0,1,2,3,0,1,2,3; high 0,0,0,0,1,1,1,1
    # 2-bit part, P = 2: byte0 = l0 | l2<<2 | l4<<4 | l6<<6 = 0 + 8 + 0 + 128 = 136
    #                    byte1 = l1 | l3<<2 | l5<<4 | l7<<6 = 1 + 12 + 16 + 192 = 221
    # 1-bit part, P = 1: byte = sum_s h_s << s = 0b11110000 = 240
    expected = torch.tensor([136, 221, 240], dtype=torch.uint8)
    assert torch.equal(pack_3bit_u8(codes), expected)
    assert torch.equal(pack_codes(codes, 3), expected)
    assert torch.equal(unpack_3bit_u8(expected), codes)
    assert packed_width(8, 3) == 3


@given(st.integers(1, 4), st.integers(0, 3), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_3bit_round_trip_and_its_two_plane_formula(rows, eighths, seed):
    length = 8 * eighths
    codes = _random_codes((rows, length), 3, seed)  # (R, L)
    packed = pack_codes(codes, 3)  # (R, 3L/8)
    assert packed.shape == (rows, packed_width(length, 3)) == (rows, 3 * length // 8)
    assert torch.equal(unpack_codes(packed, 3), codes)
    # the low bits are exactly the 2-bit layout, the high bit the 1-bit planar layout
    assert torch.equal(packed[:, : length // 4], _layout_reference(codes & 3, 2))
    assert torch.equal(packed[:, length // 4:], _layout_reference(codes >> 2, 1))


def test_3bit_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_codes(torch.zeros(12, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        pack_codes(torch.full((8,), 8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_codes(torch.zeros(8, dtype=torch.uint8), 1)  # 1-bit is only a part of 3-bit codes
