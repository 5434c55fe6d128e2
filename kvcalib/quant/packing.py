"""Bit packing of 2/3/4/8-bit integer codes into uint8 words, PLANAR layout.

This module is the specification the Triton kernels read: do not change the layout without
changing every kernel and its tests.

Layout. For ``bits`` b in {2, 4, 8}, ``per = 8 // b`` codes share one byte. Codes of shape
``(..., L)`` with ``L % per == 0`` pack into bytes of shape ``(..., P)`` with ``P = L // per``::

    byte[..., p] = sum_{s=0}^{per-1} codes[..., p + s * P] << (s * b)

i.e. the last axis is cut into ``per`` contiguous *planes* ``[s*P, (s+1)*P)`` and plane ``s``
lives in bits ``[s*b, (s+1)*b)`` of every byte. Why planar rather than interleaved (codes
``per*p + s`` in one byte): a kernel loads the ``(N, P)`` byte tile once and gets each
contiguous channel slice ``[s*P, (s+1)*P)`` as ``(bytes >> (s*b)) & mask``, so it can dot each
slice against the matching contiguous slice of ``q`` with no gathers and no repeated loads.

3-bit codes (``L % 8 == 0``) are split into two such layouts, one after the other on the last
axis: ``bytes[..., :L // 4]`` is the 2-bit planar packing of ``codes & 3`` and
``bytes[..., L // 4:]`` the 1-bit planar packing (8 planes) of ``codes >> 2``, ``3 * L // 8``
bytes in all. Why: three does not divide eight, and a code ``c = low + 4 * high`` keeps every
dot product linear, so a reader takes the low bits exactly as a 2-bit tile and adds 4x the
high-bit tile (a 10-codes-in-32-bits packing would waste 2 bits a word and cut channel slices at
odd places).

All functions accept any leading shape and non-contiguous inputs and return contiguous tensors
on the input's device. Invalid input raises :class:`ValueError`.
"""

from __future__ import annotations

import torch

__all__ = [
    "SUPPORTED_BITS",
    "packed_width",
    "pack_codes",
    "unpack_codes",
    "length_multiple",
    "unpacked_length",
    "pack_2bit_u8",
    "unpack_2bit_u8",
    "pack_3bit_u8",
    "unpack_3bit_u8",
    "pack_4bit_u8",
    "unpack_4bit_u8",
    "pack_8bit_u8",
    "unpack_8bit_u8",
]

SUPPORTED_BITS = (2, 3, 4, 8)


def _check_bits(bits: int) -> int:
    # bool is an int subclass: reject it explicitly so pack_codes(x, True) is not 1-bit
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def length_multiple(bits: int) -> int:
    """The packed axis length must be a multiple of this: ``8 // bits``, and 8 for 3-bit codes
    (their high-bit plane puts 8 codes in a byte)."""
    return 8 if _check_bits(bits) == 3 else 8 // bits


def packed_width(length: int, bits: int) -> int:
    """Number of bytes that ``length`` codes of ``bits`` bits pack into (``length * bits // 8``).

    Raises ValueError when ``bits`` is not 2, 3, 4 or 8, or ``length`` is negative or not a
    multiple of :func:`length_multiple`.
    """
    per = length_multiple(bits)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be a non-negative int, got {length!r}")
    if length % per:
        raise ValueError(
            f"{bits}-bit packing needs the packed axis length to be a multiple of {per}; got {length}"
        )
    return length * bits // 8


def unpacked_length(width: int, bits: int) -> int:
    """Codes held by ``width`` packed bytes of ``bits``-bit codes (the inverse of :func:`packed_width`)."""
    _check_bits(bits)
    if width * 8 % bits:
        raise ValueError(f"{width} bytes do not hold a whole number of {bits}-bit codes")
    return width * 8 // bits


def _check_codes(codes: torch.Tensor, bits: int) -> None:
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be torch.uint8, got {codes.dtype}")
    if codes.dim() < 1:
        raise ValueError("codes must have at least one dimension (the packed axis is the last)")
    packed_width(codes.shape[-1], bits)  # raises on a bad length
    # 8-bit codes use the whole byte, nothing to check; otherwise stray high bits would
    # silently corrupt the neighbouring plane
    if bits < 8 and codes.numel() and int(codes.max()) >= (1 << bits):
        raise ValueError(
            f"{bits}-bit codes must lie in [0, {1 << bits}), got a maximum of {int(codes.max())}"
        )


def _check_packed(packed: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be torch.uint8, got {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError("packed must have at least one dimension (the packed axis is the last)")


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar packing for ``bits`` dividing 8 (1, 2, 4); the 1-bit form is only a part of 3-bit codes."""
    if bits != 1:
        _check_codes(codes, bits)
    per = 8 // bits
    lead, length = codes.shape[:-1], codes.shape[-1]
    width = length // per
    # (..., per, P): plane s is codes[..., s*P:(s+1)*P]; reshape copies a non-contiguous input
    planes = codes.reshape(*lead, per, width)
    out = planes[..., 0, :].clone()  # (..., P)
    for s in range(1, per):
        # uint8 shift: codes < 2**b so s*b + b <= 8 and no bit is lost
        out |= planes[..., s, :] << (s * bits)
    return out.contiguous()


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits != 1:
        _check_bits(bits)
    _check_packed(packed)
    per = 8 // bits
    mask = (1 << bits) - 1
    lead, width = packed.shape[:-1], packed.shape[-1]
    # (..., per, P) -> (..., per * P): plane s lands at [s*P, (s+1)*P)
    planes = torch.stack([(packed >> (s * bits)) & mask for s in range(per)], dim=-2)
    return planes.reshape(*lead, per * width)


def pack_2bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes, planar layout.

    Args:
        codes: uint8 ``(..., L)``, values in ``[0, 4)``, ``L % 4 == 0``.

    Returns:
        uint8 ``(..., L // 4)``: ``byte[p] = c[p] | c[p+P] << 2 | c[p+2P] << 4 | c[p+3P] << 6``
        with ``P = L // 4``.
    """
    return _pack(codes, 2)


def unpack_2bit_u8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_2bit_u8`: uint8 ``(..., P)`` -> uint8 codes ``(..., 4 * P)``."""
    return _unpack(packed, 2)


def pack_4bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes, planar layout.

    Args:
        codes: uint8 ``(..., L)``, values in ``[0, 16)``, ``L % 2 == 0``.

    Returns:
        uint8 ``(..., L // 2)``: ``byte[p] = c[p] | c[p + P] << 4`` with ``P = L // 2``.
    """
    return _pack(codes, 4)


def unpack_4bit_u8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_4bit_u8`: uint8 ``(..., P)`` -> uint8 codes ``(..., 2 * P)``."""
    return _unpack(packed, 4)


def pack_8bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """"Pack" 8-bit codes: a contiguous copy. uint8 ``(..., L)`` -> uint8 ``(..., L)``."""
    _check_codes(codes, 8)
    return codes.contiguous().clone()


def unpack_8bit_u8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_8bit_u8`: a contiguous copy. uint8 ``(..., L)`` -> ``(..., L)``."""
    _check_packed(packed)
    return packed.contiguous().clone()


def pack_3bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """Pack 3-bit codes (module docstring): uint8 ``(..., L)``, values in ``[0, 8)``, ``L % 8 == 0``
    -> uint8 ``(..., 3 * L // 8)``: the 2-bit planar packing of ``codes & 3`` (``L // 4`` bytes),
    then the 1-bit planar packing of ``codes >> 2`` (``L // 8`` bytes)."""
    _check_codes(codes, 3)
    return torch.cat([_pack(codes & 3, 2), _pack(codes >> 2, 1)], dim=-1)


def unpack_3bit_u8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_3bit_u8`: uint8 ``(..., 3 * L // 8)`` -> uint8 codes ``(..., L)``."""
    _check_packed(packed)
    length = unpacked_length(packed.shape[-1], 3)
    low = _unpack(packed[..., : length // 4], 2)  # (..., L)
    high = _unpack(packed[..., length // 4:], 1)  # (..., L)
    return low | (high << 2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes: uint8 ``(..., L)``, ``bits`` in {2, 3, 4, 8} -> uint8 ``(..., L * bits // 8)``.

    8-bit codes are copied; 2-, 3- and 4-bit codes use the planar layouts of the module docstring.
    """
    bits = _check_bits(bits)
    if bits == 8:
        return pack_8bit_u8(codes)
    if bits == 3:
        return pack_3bit_u8(codes)
    return _pack(codes, bits)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack uint8 ``(..., P)`` into uint8 codes ``(..., P * 8 // bits)``, bits in {2, 3, 4, 8}."""
    bits = _check_bits(bits)
    if bits == 8:
        return unpack_8bit_u8(packed)
    if bits == 3:
        return unpack_3bit_u8(packed)
    return _unpack(packed, bits)
