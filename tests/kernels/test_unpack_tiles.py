"""3-bit code tiles through the decode kernel's unpack helpers, against the packing spec: a
token's row of 3-bit codes (a 2-bit planar part, then a 1-bit planar high part:
:func:`kvcalib.quant.packing.pack_codes`) loaded by ``_code_tile`` (bytes and int16 units,
transposed or not) and unpacked by ``_code_planes`` / ``_unit_planes`` gives plane s = channels
``[s D/4, (s+1) D/4)`` as ``low + 4 * high``, bit-exact (``1024 + code * 2**(2s)`` in the lanes
unpacks). CPU: the interpreter's unpacks 0, 1 and 6; a GPU adds the PTX lanes (5) of byte tiles
(from head_dim 128, the tiles the kernel gives them: kernels/decode/plan.py's three_bit_byte_unpack)
and of int16 units."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import kernel_modules

DEVICE, INTERPRET, (unpack,) = kernel_modules("kvcalib_kernels.decode.unpack")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvcalib.quant.packing import pack_codes  # noqa: E402

UNPACKS = [0, 1, 6] + ([5] if DEVICE == "cuda" else [])


@triton.jit
def _planes_kernel(C, OUT, stride_n, N: tl.constexpr, P: tl.constexpr, UNPACK: tl.constexpr):
    """OUT (4, N, P) float32 = the 4 planes of the (N, P) byte tile of rows C + n * stride_n."""
    offs_n = tl.arange(0, N)
    lo, hi = unpack._code_tile(C + offs_n * stride_n, offs_n < N, P, True)
    c0, c1, c2, c3 = unpack._code_planes(lo, 2, tl.float32, UNPACK, hi, True)
    o = OUT + offs_n[:, None] * P + tl.arange(0, P)[None, :]
    tl.store(o, c0.to(tl.float32))
    tl.store(o + N * P, c1.to(tl.float32))
    tl.store(o + 2 * N * P, c2.to(tl.float32))
    tl.store(o + 3 * N * P, c3.to(tl.float32))


@triton.jit
def _halves_kernel(C, OUT, stride_n, N: tl.constexpr, P: tl.constexpr, UNPACK: tl.constexpr):
    """OUT (4, N, P) float32: the 4 planes of the rows read in halves (``_key_tiles`` with HSPLIT:
    two (N, P / 2) low tiles and one high tile), half a into columns [0, P / 2), half b after."""
    offs_n = tl.arange(0, N)
    lo, lo_b, hi = unpack._key_tiles(C + offs_n * stride_n, offs_n < N, P, True, True)
    a0, a1, a2, a3 = unpack._code_planes(lo, 2, tl.float32, UNPACK, hi, True)
    b0, b1, b2, b3 = unpack._code_planes(lo_b, 2, tl.float32, UNPACK, hi, True, True)
    o = OUT + offs_n[:, None] * P + tl.arange(0, P // 2)[None, :]
    tl.store(o, a0.to(tl.float32))
    tl.store(o + N * P, a1.to(tl.float32))
    tl.store(o + 2 * N * P, a2.to(tl.float32))
    tl.store(o + 3 * N * P, a3.to(tl.float32))
    tl.store(o + P // 2, b0.to(tl.float32))
    tl.store(o + N * P + P // 2, b1.to(tl.float32))
    tl.store(o + 2 * N * P + P // 2, b2.to(tl.float32))
    tl.store(o + 3 * N * P + P // 2, b3.to(tl.float32))


@triton.jit
def _units_kernel(C, OUT, stride_n, N: tl.constexpr, U: tl.constexpr, UNPACK: tl.constexpr, T: tl.constexpr,
                  PAIR: tl.constexpr):
    """OUT (8, N, U) float32: (low byte, high byte) lanes of planes 0..3 of the (N, U) int16 unit
    tile (loaded transposed when T, then transposed back here; PAIR: the high tile in two masked
    loads, the split kernel's V_HPAIR)."""
    offs_n = tl.arange(0, N)
    lo, hi, hi_b = unpack._unit_tiles(C + offs_n * stride_n, offs_n < N, U, True, T, PAIR)
    l0, h0, l1, h1, l2, h2, l3, h3 = unpack._unit_planes(lo, 2, UNPACK, hi, True, hi_b, PAIR)
    o = OUT + offs_n[:, None] * U + tl.arange(0, U)[None, :]
    if T:
        l0, h0, l1, h1 = tl.trans(l0), tl.trans(h0), tl.trans(l1), tl.trans(h1)
        l2, h2, l3, h3 = tl.trans(l2), tl.trans(h2), tl.trans(l3), tl.trans(h3)
    tl.store(o, l0.to(tl.float32))
    tl.store(o + N * U, h0.to(tl.float32))
    tl.store(o + 2 * N * U, l1.to(tl.float32))
    tl.store(o + 3 * N * U, h1.to(tl.float32))
    tl.store(o + 4 * N * U, l2.to(tl.float32))
    tl.store(o + 5 * N * U, h2.to(tl.float32))
    tl.store(o + 6 * N * U, l3.to(tl.float32))
    tl.store(o + 7 * N * U, h3.to(tl.float32))


def _want(codes: torch.Tensor, s: int, lanes: bool) -> torch.Tensor:
    """Plane s of (N, D) codes: (N, D/4) exact values, as the unpack returns them."""
    d = codes.shape[1]
    c = codes[:, s * d // 4:(s + 1) * d // 4].double()
    return 1024 + c * 2 ** (2 * s) if lanes else c


def _codes(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 8, (n, d), generator=g, dtype=torch.uint8)  # (N, D)
    return codes, pack_codes(codes, 3)  # (N, 3 D / 8)


@pytest.mark.parametrize("warps", [1, 4], ids=lambda w: f"warps{w}")  # the split kernel runs one warp
@pytest.mark.parametrize("unpack_mode", UNPACKS, ids=lambda u: f"unpack{u}")
@pytest.mark.parametrize("d", [64, 128])
def test_byte_tiles(d, unpack_mode, warps):
    if unpack_mode == 5 and d < 128:  # a head_dim 64 tile with 4 warps came back wrong on an H200
        pytest.skip("the PTX lanes take 3-bit byte tiles from head_dim 128 (plan.three_bit_byte_unpack)")
    codes, packed = _codes(16, d, d)
    spare = torch.zeros(16, packed.shape[1] + 5, dtype=torch.uint8)  # rows in a wider buffer (a cache's stride)
    spare[:, :packed.shape[1]] = packed
    out = torch.full((4, 16, d // 4), -1.0, device=DEVICE)  # (4, N, D/4): poisoned
    _planes_kernel[(1,)](spare.to(DEVICE), out, spare.shape[1], 16, d // 4, unpack_mode, num_warps=warps)
    got = out.cpu().double()
    if unpack_mode == 5:  # the PTX lanes return bytes (0, 2, 1, 3) of each 4 columns: put them back
        cols = torch.arange(d // 4)
        got = got[:, :, (cols & ~3) | ((cols & 1) << 1) | ((cols >> 1) & 1)]
    for s in range(4):
        assert torch.equal(got[s], _want(codes, s, unpack_mode in (5, 6))), s


@pytest.mark.parametrize("warps", [1, 4], ids=lambda w: f"warps{w}")
@pytest.mark.parametrize("unpack_mode", UNPACKS, ids=lambda u: f"unpack{u}")
@pytest.mark.parametrize("d", [128, 256])
def test_byte_tile_halves(d, unpack_mode, warps):
    """Key rows read in halves (the split kernel's K_HSPLIT, from head_dim 128: P / 2 >= 16 columns
    for tl.dot): the low bytes' halves with the one contiguous high tile, the second half taking
    bit 2s + 1 of each high byte, give the same planes as the aligned tiles."""
    codes, packed = _codes(16, d, d + 1)
    spare = torch.zeros(16, packed.shape[1] + 16, dtype=torch.uint8)  # rows in a wider buffer (a cache's stride)
    spare[:, :packed.shape[1]] = packed
    out = torch.full((4, 16, d // 4), -1.0, device=DEVICE)  # (4, N, D/4): poisoned
    _halves_kernel[(1,)](spare.to(DEVICE), out, spare.shape[1], 16, d // 4, unpack_mode, num_warps=warps)
    got = out.cpu().double()
    if unpack_mode == 5:  # bytes (0, 2, 1, 3) of each 4 columns (the halves are multiples of 4)
        cols = torch.arange(d // 4)
        got = got[:, :, (cols & ~3) | ((cols & 1) << 1) | ((cols >> 1) & 1)]
    for s in range(4):
        assert torch.equal(got[s], _want(codes, s, unpack_mode in (5, 6))), s


@pytest.mark.parametrize("unpack_mode", [m for m in UNPACKS if m in (5, 6)], ids=lambda u: f"unpack{u}")
@pytest.mark.parametrize("pair", [False, True], ids=["select", "pair"])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_unit_tiles(transposed, unpack_mode, pair):
    d = 128
    codes, packed = _codes(16, d, 7)
    units = packed.view(torch.int16)  # (N, 3 D / 16): two bytes a unit
    out = torch.full((8, 16, d // 8), -1.0, device=DEVICE)  # (8, N, U): poisoned
    _units_kernel[(1,)](units.to(DEVICE), out, units.shape[1], 16, d // 8, unpack_mode, transposed, pair)
    got = out.cpu().double()
    for s in range(4):
        want = _want(codes, s, True)  # (N, D/4): unit u holds columns 2u (low byte) and 2u + 1 (high)
        assert torch.equal(got[2 * s], want[:, 0::2]), (s, "low")
        assert torch.equal(got[2 * s + 1], want[:, 1::2]), (s, "high")
