"""The launcher of :mod:`.split_kernel` (+ :mod:`.combine`): what a caller may tune
(:class:`DecodeConfig`), the rules that pick the kernel's compile-time paths for a layout, the
lane-unpack check on the device, the argument checks, and the launch.

Rotated packed sides (``k_rot`` / ``v_rot``, :mod:`.rotation`): the query is rotated by the split
kernel itself for a random-sign Walsh-Hadamard rotation (``ROT_Q``: a fast transform in registers), by its own launch (:func:`.rotation.rotate_query`) before the split
kernel for a fitted matrix; the value accumulators rotate
back inside the combine (:func:`.combine._combine_rotated`) on calls of at least
:data:`COMBINE_ROTATION_MIN_ROWS` (batch x kv heads) rows, else by their own launch
(:func:`.rotation.rotate_back_partials`) before it.

Every rule below is the setting that measured fastest on an H200 where it applies (CUDA-graph
time of the benchmark shapes); the settings that lost were removed from the code, and their
numbers, commands and commits are in ``artifacts/bench/HISTORY.md`` ("Settings removed from the
code").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kvcalib.quant.rotation import check_rotation, is_hadamard
from kvcalib_kernels.decode.combine import _combine, _combine_rotated
from kvcalib_kernels.decode.rotation import rotate_back_partials, rotate_query
from kvcalib_kernels.decode.common import (LOG2E, _cdiv, _check_fp, _dummy, _fp_segment_args, _interpreting,
                                           _packed_range, _pow2_divisor, _tl_dtype, _visibility)
from kvcalib_kernels.decode.split_kernel import _decode_split_kernel
from kvcalib_kernels.decode.splits import SplitRule, _partials, _split_plan
from kvcalib_kernels.decode.unpack import _probe_bytes_kernel
from kvcalib_kernels.launch import FastLauncher


@dataclass(frozen=True)
class DecodeConfig:
    """What a caller may tune (results do not depend on it beyond float rounding).

    - ``block_n``: packed tokens per loop step; per-channel keys clamp it to the key groups (a
      block holds one key group, or two in its halves or as two sets of query rows).
    - ``fp_block``: tokens per full-precision chunk program (sinks, window, OTT pool).
    - ``num_warps``, ``num_stages``: Triton launch options of the split kernel (the split kernel
      gets one more stage where :func:`_stages` says so). One warp: with the GQA group's few query
      rows as a tile, more warps only repeat the same products and softmax; parallelism comes
      from more split programs instead.
    - ``unpack``: how codes become float16 (:mod:`.unpack`). None: the fastest verified here
      (5 on a GPU where the lane PTX checks out for the layout, else 2, else 6). 5 / 6: the lane
      unpack in PTX / in Triton ops on the folded sides (the others take 2 / 1); 0 / 1 / 2: plain
      codes on every side (``.to``, Triton ops, PTX). Float32 queries always take 0.
    - ``programs_per_sm``, ``num_splits``: split-K parallelism (:class:`.splits.SplitRule`).
    """

    block_n: int = 64
    fp_block: int = 64
    num_warps: int = 1
    num_stages: int = 2
    unpack: int | None = None
    programs_per_sm: float = 8.0
    num_splits: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_n", "fp_block"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")
        if self.unpack not in (None, 0, 1, 2, 5, 6):
            raise ValueError(f"unpack must be None, 0, 1, 2, 5 or 6, got {self.unpack!r}")
        if not self.programs_per_sm > 0:
            raise ValueError(f"programs_per_sm must be > 0, got {self.programs_per_sm!r}")
        if self.num_splits is not None and (isinstance(self.num_splits, bool) or not isinstance(self.num_splits, int)
                                            or self.num_splits < 1):
            raise ValueError(f"num_splits must be None or a positive int, got {self.num_splits!r}")


DEFAULT_CONFIG = DecodeConfig()

# ---------------------------------------------------------------- the rules (HISTORY.md has their numbers)

MIN_ROWS = 4  # query tile rows: the GQA group padded to a power of two >= 4 (16, one whole MMA tile, was slower)
SMALL_BLOCK_N = 32  # blocks of a short cache with few (batch, kv head) rows (_prepare): more split programs
HALVES_SPLIT_GAIN = 1.5  # one key group per block instead of two halves where that gives >= 1.5x the splits ...
HALVES_MAX_SPLITS = 256  # ... and no more splits per row than this (their merge would cost more)
DEEP_PIPELINE_BLOCKS = 16  # a third pipeline stage where every split runs at least this many blocks (_stages)
# rotated values rotate back inside the combine from this many (batch x kv head) rows of a call on
# (_back_rotation_in_combine); benchmarks and tests set it (0: always there, a huge number: never)
COMBINE_ROTATION_MIN_ROWS = 32

# A random-sign Walsh-Hadamard rotation of the keys (the shared tensor, kvcalib.quant.rotation.is_hadamard):
# the split kernel rotates the query itself (ROT_Q, a fast transform) rather than a launch before it
# (rotation.rotate_query, which fitted matrices keep, and a copy of the Hadamard matrix too: what
# benchmarks.fitted's rotate-qlaunch-* variants pass). H100, Mistral-7B shape, K and V rotated,
# CUDA-graph us per call, in kernel / by a launch (back-rotation as COMBINE_ROTATION_MIN_ROWS picks):
# batch 1 4k 2-bit 16.8 / 22.2, batch 1 32k 24.5 / 28.7, batch 8 32k 2-bit 75.5 / 81.1 (plain 71.1),
# 4-bit 112.2 / 117.7 (plain 107.8): docs/results.md.


@functools.lru_cache(maxsize=None)
def _split_rule(config: DecodeConfig) -> SplitRule:
    """The split-K rule of a config: its parallelism fields over :class:`.splits.SplitRule`'s defaults."""
    return SplitRule(programs_per_sm=config.programs_per_sm, num_splits=config.num_splits)


def _back_rotation_in_combine(rows: int) -> bool:
    """Whether a call of ``rows`` = batch x kv heads rows rotates its value accumulators back
    inside the combine (:func:`.combine._combine_rotated`, no launch of its own) rather than by
    :func:`.rotation.rotate_back_partials`' launch before a plain combine: from
    :data:`COMBINE_ROTATION_MIN_ROWS` rows on.

    The rotating combine runs one program per (batch, kv head, 64 channels), each over all of its
    rows' partials, so with few rows it has few programs for hundreds of partials; the plain
    combine has one per (query row, 16 or 32 channels). H100, Mistral-7B shape (32 query heads, 8 kv
    heads, head_dim 128, group 128), CUDA-graph time per attention call in us, rotated K and V
    (random-sign Walsh-Hadamard; ``python -m benchmarks.fitted --variants
    plain,rotate-2launch,rotate-combine,...``, 2026-11-26):

    ====================  =====  ==========  =======================
    batch, context, bits  plain  2 launches  back-rotation in combine
    ====================  =====  ==========  =======================
    1, 4k, 2               8.3     22.3        22.0
    1, 4k, 4               8.9     23.6        22.6
    1, 32k, 2             15.3     29.3        36.1
    1, 32k, 4             20.6     34.3        40.7
    8, 32k, 2             70.6     84.9        81.4
    8, 32k, 4            107.7    120.7       118.1
    ====================  =====  ==========  =======================

    At batch 1 (8 rows: 16 rotating-combine programs) it loses 6.4-6.8 us at 32k and gains only
    0.3-1.0 us at 4k, so batch 1 takes the two launches; at batch 8 (64 rows: 128 programs) it saves
    the launch, 2.6-3.5 us. 32 lies between the two measured row counts (8 and 64); nothing
    between them was measured. (The query rotated inside the split
    kernel by a +-1 matrix product, the third variant of that run, was removed: it lost at batch 8
    (2-bit: +63% over plain against +15%) and at batch 1 / 32k, and won only at batch 1 / 4k (0.5
    us at 2 bits, 2.6 at 4; artifacts/bench/HISTORY.md, "Rotation paths removed from the code").
    With the fast transform that now rotates a Walsh-Hadamard query in the split kernel
    (``ROT_Q``) the rule holds as it was (H100, 2026-11-27, two launches /
    in the combine: batch 1 4k 2-bit 16.8 / 16.4, 32k 24.5 / 31.5; batch 8 32k 2-bit 79.8 / 75.5).)
    """
    return rows >= COMBINE_ROTATION_MIN_ROWS


def _key_group_pairs(d: int, r_pad: int, k_bits: int, v_bits: int) -> bool:
    """Per-channel key groups of half a block as two sets of virtual query rows (one key product
    and softmax per block, merged at the end): at head_dim <= 64 with <= 4 padded query rows and
    <= 4 bits (SmolLM2 shape, groups of 32, batch 8 / 32k 2-bit 82.9 -> 41.9 us); elsewhere the
    doubled rows cost more registers than they save, and the groups run in the block's halves."""
    return d <= 64 and r_pad <= 4 and max(k_bits, v_bits) <= 4


def _value_sum_products(v_bits: int, k_sub: int) -> bool:
    """Folded value planes take their lane 1024 terms from small products with a constant tile
    instead of reductions across the warp: at 2 bits with one key group per block only (Mistral
    batch 8 / 32k 99.5 -> 96.6 us; 4-bit within 1%, 8-bit and key-group pairs slower)."""
    return v_bits == 2 and k_sub == 1


def _value_products_t(v_units: bool, v_chunks: int, k_halves: bool, v_bits: int, v_mean: int) -> bool:
    """Transposed value products (channels as the MMA's M rows, the query rows its N): on value
    codes read as units without a TaDA value mean, but for value-group accumulators of <= 4 bits
    beside keys in block halves (4-bit groups 32 / 32), where they measured no faster."""
    return v_units and not v_mean and not (v_chunks > 1 and k_halves and v_bits <= 4)


def _whole_blocks(d: int, r_pad: int, k_bits: int, v_bits: int) -> bool:
    """Whether a call whose packed blocks are all whole and visible runs its loop unmasked: at
    head_dim >= 128 with <= 4 padded query rows, or at 2 bits (measured faster there; the Qwen
    shape's 8 padded rows at 4 bits and head_dim 64 were slower)."""
    return d >= 128 and (r_pad <= 4 or k_bits == v_bits == 2)


def _early_value_scales(v_bits: int) -> bool:
    """Each block's value scales and zeros load at the top of the block, before the key work that
    hides their latency (Mistral batch 8 / 32k 2-bit 90.9 -> 81.5 us), for values of <= 4 bits: at
    8 bits the extra live registers / shared memory let fewer programs share an SM."""
    return v_bits <= 4


def _stages(num_stages: int, blocks_per_split: int, deep_layout: bool) -> int:
    """Pipeline stages of the split kernel: ``num_stages``, one more where every packed split runs
    at least :data:`DEEP_PIPELINE_BLOCKS` blocks of a layout that takes it (``deep_layout``: <= 4
    bits, one key group folded per block, one value accumulator per plane, no TaDA means; Mistral
    batch 8 / 32k 2-bit 81.0 -> 78.4 us; short splits and value-group layouts were slower, and at
    8 bits three stages of code tiles leave room for fewer programs per SM)."""
    return num_stages + (deep_layout and blocks_per_split >= DEEP_PIPELINE_BLOCKS)


# 3-bit codes read as byte tiles (keys; values too narrow for int16 units): the PTX lanes (5) with
# the aligned high tile as a second operand (4 bytes of each a register) where a code plane is at
# least THREE_BIT_BYTE_LANES_MIN_D / 4 bytes wide, else the lanes in Triton ops (6). H200, triton
# 3.6 (artifacts/bench/HISTORY.md, "3-bit byte tiles on the PTX lanes"): head_dim 128 tiles are
# exact with 1 and 4 warps and the Mistral-7B shape at batch 8 / 32k runs 1.12x bf16 against
# 0.90x with 6; a head_dim 64 tile (16 x 16) with 4 warps came back wrong (two elements a thread,
# fewer than the 4 the PTX packs). The kernel-level lane check (_lanes_verified) still compares
# each layout against unpack 6 on the device before its first use.
THREE_BIT_BYTE_LANES_MIN_D = 128


def three_bit_byte_unpack(d: int) -> int:
    """The unpack of a 3-bit byte tile at head_dim ``d`` (see THREE_BIT_BYTE_LANES_MIN_D)."""
    return 5 if d >= THREE_BIT_BYTE_LANES_MIN_D else 6


# 3-bit folded keys read in two halves of a row (the kernel's K_HSPLIT): low bytes [0, P/2) and
# [P/2, P) and the P/2 high bytes, each one contiguous tile, the halves' planes times the matching
# halves of the folded query planes (8 products of K = P/2 instead of 4 of K = P). The aligned
# high tile this replaces needs a column-dependent select, which keeps Triton from carrying the MMA
# operand layout through the unpack: the four key plane tiles went through shared memory (sm_90,
# offline: artifacts/bench/three_bit_sass.md). tl.dot needs K >= 16, so from head_dim 128
# (P/2 = D/8 columns); head_dim 64 keeps the aligned tile. Off: the aligned tile everywhere (the
# GPU A/B's other side). Not with two key groups per block (K_HALVES: the kernel takes it, but
# its (BLOCK_N / 2, P / 2) half-block tiles were not pipelined and their planes still went through
# shared memory: sm_90 offline, key group 32 / block 64, loop 2417 -> 3049 SASS instructions).
THREE_BIT_KEY_HALVES = True


def three_bit_key_halves(d: int, k_bits: int, k_fold: bool, k_halves: bool) -> bool:
    """Whether 3-bit keys at head_dim ``d`` are read in row halves (THREE_BIT_KEY_HALVES)."""
    return THREE_BIT_KEY_HALVES and k_fold and not k_halves and k_bits == 3 and d // 8 >= 16


# 3-bit value units of a head_dim 128 row (the kernel's V_HPAIR, where V_ROW8 holds): the high tile
# aligned with the (PV / 2)-unit low tile in two loads masked by column (the first half's columns,
# whose high bit is bit 2s, and the second half's, bit 2s + 1; the unpack ORs them, the second
# shifted down one), instead of one load and a column-dependent select, which kept Triton from
# carrying the MMA operand layout through the unpack (the 8 value plane tiles went through shared
# memory: artifacts/bench/three_bit_sass.md). Off: the select (the GPU A/B's other side).
THREE_BIT_VALUE_PAIR = True


def three_bit_value_pair(v_bits: int, v_row8: bool) -> bool:
    """Whether 3-bit value units load their high tile as two masked tiles (THREE_BIT_VALUE_PAIR)."""
    return THREE_BIT_VALUE_PAIR and v_bits == 3 and v_row8


# ---------------------------------------------------------------- layouts


def plane_bits(bits: int) -> int:
    """Bits of the code planes the split kernel folds and multiplies: a 3-bit side is its 2-bit
    planar part (4 planes, shifts 0/2/4/6) with the high bit added into each plane's codes
    (``K_HI``/``V_HI``, :mod:`.unpack`); every other width is its own."""
    return 2 if bits == 3 else bits


def supports(*, head_dim: int, k_bits: int, v_bits: int, k_group: int, v_group: int,
             k_axis: str = "channel", rep: int = 1, block_n: int = DEFAULT_CONFIG.block_n) -> str | None:
    """None when :func:`kvcalib_kernels.decode_attention.decode_attention` handles this layout,
    else the reason it does not."""
    d = head_dim
    if d < 16 or d & (d - 1) or d > 512:
        return f"head_dim {d} is not a power of two in [16, 512]"
    for side, bits in (("k", k_bits), ("v", v_bits)):
        if bits not in (2, 3, 4, 8):
            return f"{side}_bits {bits} is not 2, 3, 4 or 8"
        if d * plane_bits(bits) // 8 < 16:  # (a 3-bit side's planes are its 2-bit part's)
            return (f"{side}: {bits}-bit codes of head_dim {d} give code planes of fewer than 16 bytes "
                    "(tl.dot needs >= 16)")
    if k_axis not in ("channel", "token"):
        return f"k_axis {k_axis!r} is not 'channel' or 'token'"
    if k_axis == "channel" and _pow2_divisor(k_group, block_n) < 16:
        return f"k_group {k_group} has no power-of-two divisor >= 16 (the key-scale fold needs one)"
    if k_axis == "token" and d % k_group:
        return f"k_group {k_group} does not divide head_dim {d}"
    if d % v_group:
        return f"v_group {v_group} does not divide head_dim {d}"
    if rep < 1 or rep > 64:
        return f"{rep} query heads per kv head is outside [1, 64]"
    return None


def value_fold(head_dim: int, v_bits: int, v_group: int) -> tuple[bool, int]:
    """How the split kernel reads values of this layout: ``(fold, chunks)``. ``(True, 1)``: a plane
    of codes lies in one value group, ``p * scale`` folds in once per plane; ``(True, c)``: value
    groups narrower than a plane (at most 4 per head) fold per (plane, chunk of ``v_group`` byte
    columns), one accumulator per group (Mistral shape, 4-bit values in groups of 32, batch 8 /
    32k: 173.8 -> 130.7 us against per-element); ``(False, 1)``: per-element dequantization."""
    pv = head_dim * v_bits // 8
    if v_group >= pv and v_group % pv == 0:
        return True, 1
    if pv % v_group == 0 and head_dim // v_group <= 4 and v_group >= 16:
        return True, pv // v_group
    return False, 1


# ---------------------------------------------------------------- the lane unpack, checked on the device


FAST_UNPACK_ERROR: dict[str, str] = {}  # kind -> why fast_unpack_available(kind=...) said False
_PROBING_LANES = False  # set while _lanes_verified runs the kernel with unpack=5 (no recursion)


def _lanes_mismatch(dev: torch.device, d: int, rep: int, k_bits: int, v_bits: int, k_group: int, v_group: int,
                    k_axis: str, config: DecodeConfig) -> str | None:
    """Run the split kernel of this layout and config with the PTX lane unpack (5) and with the
    same arithmetic in Triton ops (6) on random packed K/V; None when they agree, else what
    differed. The lane order the kernel undoes depends on how Triton lays the MMA operand
    registers out for the tile (seen to differ with two warps on one layout), so each compiled
    variant is checked on the device once before it is used. Two splits of several blocks each:
    with one block per split (what the plan gives so short a cache) two warps' lanes agreed here
    and were wrong across blocks (error 2.0 on the GPU grid case d=64, GQA 3, K8V2)."""
    global _PROBING_LANES

    gen = torch.Generator(device="cpu").manual_seed(0)
    h = 2
    n = 4 * k_group * max(1, 256 // k_group) if k_axis == "channel" else 512  # whole key groups
    q = torch.randn(1, h * rep, d, generator=gen).to(dev, torch.float16)

    def side(bits, group, per_token):
        codes = torch.randint(0, 256, (1, h, n, d * bits // 8), generator=gen, dtype=torch.uint8).to(dev)
        shape = (1, h, n, d // group) if per_token else (1, h, n // group, d)
        scale = (torch.rand(shape, generator=gen) * 0.2 + 0.01).to(dev, torch.float16)
        zero = torch.randn(shape, generator=gen).to(dev, torch.float16)
        return codes, scale, zero

    kc, ks, kz = side(k_bits, k_group, k_axis == "token")
    vc, vs, vz = side(v_bits, v_group, True)
    outs = []
    _PROBING_LANES = True
    try:
        for unpack in (5, 6):
            outs.append(_launch(q, kc, ks, kz, vc, vs, vz, k_bits=k_bits, v_bits=v_bits, k_group=k_group,
                                v_group=v_group, k_axis=k_axis, scaling=d ** -0.5, softcap=None, packed_start=None,
                                packed_end=None, packed_position=0, fp_segments=[], fp_positions=[], mask=None,
                                config=replace(config, unpack=unpack, num_splits=2)))
    finally:
        _PROBING_LANES = False
        _plan.cache_clear()  # plans made while probing trusted the lanes
    err = (outs[0] - outs[1]).abs().max().item()
    if not err <= 1e-3 * max(1.0, outs[1].abs().max().item()):
        return f"lane unpack differs from the Triton-ops lanes by {err:.3g}"
    return None


LANES_REFUSED: dict[tuple, str] = {}  # (layout, config) -> why its lane unpack was not used


@functools.lru_cache(maxsize=None)
def _lanes_verified(dev_index, d, rep, k_bits, v_bits, k_group, v_group, k_axis, config) -> bool:
    """Whether the lane unpack (5) of this layout and config compiles and agrees with unpack 6 on
    this GPU (once per variant; the reason for a refusal is kept in ``LANES_REFUSED``)."""
    key = (d, rep, k_bits, v_bits, k_group, v_group, k_axis, config)
    try:
        why = _lanes_mismatch(torch.device("cuda", dev_index), d, rep, k_bits, v_bits, k_group, v_group, k_axis,
                              config)
    except Exception as err:  # noqa: BLE001 - any compile/launch failure means "do not use it"
        why = f"{type(err).__name__}: {err}"[:2000]
    if why:
        LANES_REFUSED[key] = why
    return why is None


@functools.lru_cache(maxsize=None)
def fast_unpack_available(device_index: int = 0, kind: str = "bytes") -> bool:
    """Whether an inline-PTX unpack (``kind="bytes"``: ``unpack=2``; ``"lanes"``: ``unpack=5`` on
    the Mistral-7B layouts at the default config) compiles and is exact on this GPU.

    Checked once per device (bytes: on random bytes against ``(x >> shift) & mask``); False on CPU
    / in the interpreter (no inline assembly there) or if anything fails (the reason is kept in
    ``FAST_UNPACK_ERROR[kind]``).
    """
    if kind not in ("bytes", "lanes"):
        raise ValueError(f"kind must be 'bytes' or 'lanes', got {kind!r}")
    if _interpreting() or not torch.cuda.is_available():
        FAST_UNPACK_ERROR[kind] = "no CUDA device (or the interpreter)"
        return False
    try:
        dev = torch.device("cuda", device_index)
        if kind == "lanes":  # the Mistral-7B layout at the default config
            why = _lanes_mismatch(dev, 128, 4, 2, 2, 128, 128, "channel", DEFAULT_CONFIG)
            if why is None:
                why = _lanes_mismatch(dev, 128, 4, 4, 4, 128, 128, "channel", DEFAULT_CONFIG)
            if why:
                FAST_UNPACK_ERROR[kind] = why
            return why is None
        x = torch.randint(0, 256, (64, 32), dtype=torch.uint8, device=dev)
        for bits in (2, 4, 8):
            for shift in range(0, 8, bits):
                y = torch.empty(x.shape, dtype=torch.float16, device=dev)
                _probe_bytes_kernel[(1,)](x, y, shift, bits, 64, 32)
                want = ((x >> shift) & ((1 << bits) - 1)).half()
                if not torch.equal(y, want):
                    FAST_UNPACK_ERROR[kind] = f"wrong codes for bits={bits} shift={shift}"
                    return False
        return True
    except Exception as err:  # noqa: BLE001 - any compile/launch failure means "not available here"
        FAST_UNPACK_ERROR[kind] = f"{type(err).__name__}: {err}"[:2000]
        return False


@functools.lru_cache(maxsize=None)
def _check_layout(d, rep, k_bits, v_bits, k_group, v_group, k_axis, block_n) -> None:
    why = supports(head_dim=d, k_bits=k_bits, v_bits=v_bits, k_group=k_group, v_group=v_group,
                   k_axis=k_axis, rep=rep, block_n=block_n)
    if why:
        raise ValueError(f"decode_attention does not support this layout: {why}")


class Plan(NamedTuple):
    """The split kernel's compile-time choices for one layout (:func:`_plan`)."""

    k_unpack: int  # (.unpack) codes of the key side
    v_unpack: int  # ... and of the value side
    dot_t: Any  # operand type of the packed products (tl.float16, tl.float32 for float32 queries)
    ieee: bool  # float32 products in IEEE precision
    block_n: int  # packed tokens per loop step
    k_fold: bool  # per-channel key scales folded into the query planes
    v_fold: bool  # per-token value scales folded into p (value_fold)
    v_chunks: int  # value-group accumulators per plane (value_fold)
    r_pad: int  # query tile rows
    fp_t: Any  # operand type of the full-precision products
    fp_ieee: bool
    fp_block: int  # tokens per full-precision chunk
    k_halves: bool  # two key groups per block, one per half


@functools.lru_cache(maxsize=None)
def _plan(d, rep, k_bits, v_bits, k_group, v_group, k_axis, q_dtype, fp_dtype, dev_type, dev_index, config,
          interp, halves: bool = True) -> Plan:
    """The kernel's compile-time choices for one layout (cached). ``halves``: two key groups per
    block may run in its halves (off: one key group per block, see :func:`_prepare`)."""
    ieee = q_dtype == torch.float32
    dot_t = tl.float32 if ieee else tl.float16
    unpack = config.unpack
    cuda = dev_type == "cuda"

    def lanes_ok():
        return cuda and (_PROBING_LANES or _lanes_verified(dev_index, d, rep, k_bits, v_bits, k_group, v_group,
                                                           k_axis, config))

    if ieee:
        unpack = 0  # exact float32 codes; the float16 tricks are for the float16 products
    elif unpack is None:  # the fastest that works here (DecodeConfig.unpack)
        unpack = 5 if lanes_ok() else 2 if (cuda and fast_unpack_available(dev_index, "bytes")) else 6
    elif unpack == 2 and not (cuda and fast_unpack_available(dev_index, "bytes")):
        unpack = 1  # no inline PTX here: the same codes in Triton ops
    elif unpack == 5 and not lanes_ok():
        unpack = 2 if (cuda and fast_unpack_available(dev_index, "bytes")) else 6
    r_pad = max(MIN_ROWS, triton.next_power_of_2(rep))
    block_n = config.block_n
    k_halves = False
    if k_axis == "channel":  # blocks of one key group, or of two when key groups are shorter
        kgb = _pow2_divisor(k_group, config.block_n)
        pairs = _key_group_pairs(d, r_pad, plane_bits(k_bits), plane_bits(v_bits))
        # otherwise two groups per block without virtual rows, one per half of the block
        k_halves = (not pairs) and halves and 2 * kgb == config.block_n
        block_n = min(config.block_n, 2 * kgb) if (pairs or k_halves) else kgb
    k_fold = k_axis == "channel"
    v_fold, v_chunks = value_fold(d, plane_bits(v_bits), v_group)
    # the lane unpacks (5 PTX, 6 Triton ops) leave 1024 + c * 2**shift for the folds to remove; a
    # side that dequantizes per element (no fold) takes the byte unpack of the same kind instead
    plain = 2 if (unpack == 5 and cuda and fast_unpack_available(dev_index, "bytes")) else 1
    k_unpack = plain if (unpack in (5, 6) and not k_fold) else unpack
    v_unpack = plain if (unpack in (5, 6) and not v_fold) else unpack
    if k_unpack == 5 and k_bits == 3:
        k_unpack = three_bit_byte_unpack(d)
    # the interpreter's tl.dot has no bfloat16 (stored as uint16 there): float32 products instead
    fp_t = tl.float32 if (fp_dtype == torch.float32 or interp) else _tl_dtype(fp_dtype)
    fp_ieee = fp_dtype == torch.float32 or interp
    fp_block = max(16, min(config.fp_block, 8192 // d))  # (FP_BLOCK, D) K and V tiles: keep them <= 8K elements
    return Plan(k_unpack, v_unpack, dot_t, ieee, block_n, k_fold, v_fold, v_chunks, r_pad, fp_t, fp_ieee, fp_block,
                k_halves)


@functools.lru_cache(maxsize=None)
def _with_block_n(config: DecodeConfig, block_n: int) -> DecodeConfig:
    """``config`` with another ``block_n`` (one object per pair: the plan cache keys on it)."""
    return replace(config, block_n=block_n)


def _check_perm(name: str, perm, h: int, d: int, dev) -> torch.Tensor:
    """An SKVQ permutation as the kernel reads it: int32 (H, D) contiguous on ``dev``."""
    if perm.dim() != 2 or tuple(perm.shape) != (h, d) or perm.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32/int64 (H={h}, D={d}) permutation, got "
                         f"{perm.dtype} {tuple(perm.shape)}")
    if perm.device != dev:
        raise ValueError(f"{name} is on {perm.device}, the query on {dev}")
    return perm if (perm.dtype == torch.int32 and perm.is_contiguous()) else perm.to(torch.int32).contiguous()


def _check_mean(name: str, mean, b: int, n: int, d: int):
    """A TaDA mean as the kernel reads it: ``(bits, values, scale, zero)``. ``mean`` is float16
    ``(B, 1, N, D)`` (16-bit) or a tuple ``(codes uint8 (B, 1, N, D), scale, zero float16
    (B, 1, N, 1))`` (8-bit per-token codes over all D channels)."""
    if isinstance(mean, torch.Tensor):
        if mean.dtype != torch.float16 or tuple(mean.shape) != (b, 1, n, d) or mean.stride(3) != 1:
            raise ValueError(f"{name} must be float16 (B={b}, 1, N={n}, D={d}) with a contiguous last dim, got "
                             f"{mean.dtype} {tuple(mean.shape)}")
        return 16, mean, None, None
    if not isinstance(mean, (tuple, list)) or len(mean) != 3:
        raise ValueError(f"{name} must be a float16 tensor or a (codes, scale, zero) tuple")
    codes, scale, zero = mean
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (b, 1, n, d) or codes.stride(3) != 1:
        raise ValueError(f"{name}: codes must be uint8 (B={b}, 1, N={n}, D={d}), got {codes.dtype} {tuple(codes.shape)}")
    for part, t in (("scale", scale), ("zero", zero)):
        if t.dtype != torch.float16 or tuple(t.shape) != (b, 1, n, 1):
            raise ValueError(f"{name}: {part} must be float16 (B={b}, 1, N={n}, 1), got {t.dtype} {tuple(t.shape)}")
    if scale.stride() != zero.stride():
        raise ValueError(f"{name}: scale and zero must have the same strides")
    return 8, codes, scale, zero


@dataclass
class _SplitCall:
    """One planned launch of :func:`_decode_split_kernel`: its grid ``(B * H, s_tot)`` and every
    argument after the queries and the partial buffers; ``q_packed`` (B, Hq, D) float32: the query
    its packed splits score with (None: the call's query); ``v_rot``: the rotation its packed
    splits' accumulators are rotated back by (None: stored unrotated), over its first ``splits``
    partial columns (inside the combine or by a launch before it: :func:`_combine_rotated_calls`)."""

    bh: int
    s_tot: int
    args: tuple
    meta: dict
    splits: int = 0
    q_packed: torch.Tensor | None = None
    v_rot: tuple | None = None


def _check_rot(name: str, rot, h: int, d: int, dev) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A rotation as the launcher applies it: ``(matrix (D, D) | (H, D, D), signs (H, D) | None)``
    float32 on ``dev`` (:mod:`kvcalib.quant.rotation`): the caller's tensors themselves (the
    combine recognises one rotation of several parts by identity)."""
    if not isinstance(rot, (tuple, list)) or len(rot) != 2:
        raise ValueError(f"{name} must be a (matrix, signs) pair")
    matrix, signs = rot
    try:
        check_rotation(matrix, signs, h, d)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    for t in (matrix, signs):
        if t is not None and (t.device != dev or t.dtype != torch.float32):
            raise ValueError(f"{name} must be float32 on {dev}, got {t.dtype} on {t.device}")
    return matrix, signs


def _prepare(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, *, k_bits, v_bits, k_group, v_group,
             k_axis, scaling, softcap, packed_start, packed_end, packed_position, fp_segments, fp_positions,
             mask, config: DecodeConfig, k_perm=None, v_perm=None, k_mean=None, v_mean=None,
             mask_packed: bool = True, keep=None, keep_block: int = 0, pool=None, k_rot=None,
             v_rot=None) -> _SplitCall | None:
    """Check shapes/dtypes/contiguity, pick the code path and plan the split kernel's launch
    (None: nothing to attend to). ``q`` must have a contiguous last dim.

    Shapes: q (B, Hq, D); k_codes (B, H, N, PK) u8, PK = D*k_bits/8; k_scale/k_zero f16
    (B, H, N/k_group, D) [channel] or (B, H, N, D/k_group) [token]; v_codes (B, H, N, PV) u8;
    v_scale/v_zero f16 (B, H, N, D/v_group); fp segments (B, H, F, D); mask (B|1, L) bool/u8;
    packed_start/end (B,) int; k_perm/v_perm (H, D) int; k_mean/v_mean see :func:`_check_mean`;
    keep (B, H, R) u8 quant masks in blocks of keep_block tokens; pool (k, v (B, H, P, D), pos (B, H, P));
    k_rot/v_rot rotations of the packed sides (:func:`_check_rot`).
    """
    bsz, hq, d = q.shape
    dev = q.device
    fp = [tuple(s) for s in fp_segments if s is not None and s[0] is not None and s[0].shape[2] > 0]
    positions = list(fp_positions) or [0] * len(fp_segments)
    fp_pos = [p for s, p in zip(fp_segments, positions) if s is not None and s[0] is not None and s[0].shape[2] > 0]
    if len(fp) > 2:
        raise ValueError(f"at most two full-precision segments, got {len(fp)}")
    n = 0 if k_codes is None else int(k_codes.shape[2])
    if pool is not None and pool[0].shape[2] == 0:
        pool = None
    if k_codes is not None:
        h = k_codes.shape[1]
    elif fp:
        h = fp[0][0].shape[1]
    elif pool is not None:
        h = pool[0].shape[1]
    else:
        return None
    if hq % h:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {h}")
    rep = hq // h
    _check_layout(d, rep, k_bits, v_bits, k_group, v_group, k_axis, config.block_n)
    for i, pair in enumerate(fp):
        _check_fp(pair, bsz, h, d, i)
    pk, pv = d * k_bits // 8, d * v_bits // 8  # bytes a token's codes take (3-bit: 2-bit part + high part)
    if n:
        for name, t, shape in (("k_codes", k_codes, (bsz, h, n, pk)), ("v_codes", v_codes, (bsz, h, n, pv))):
            if t is None or t.dtype != torch.uint8 or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be uint8 {shape}, got {None if t is None else (t.dtype, tuple(t.shape))}")
            if t.stride(3) != 1:
                raise ValueError(f"{name}: the packed (last) dim must be contiguous")
        kshape = (bsz, h, n // k_group, d) if k_axis == "channel" else (bsz, h, n, d // k_group)
        if k_axis == "channel" and n % k_group:
            raise ValueError(f"per-channel keys: N={n} must be a multiple of k_group={k_group}")
        vshape = (bsz, h, n, d // v_group)
        for name, t, shape in (("k_scale", k_scale, kshape), ("k_zero", k_zero, kshape),
                               ("v_scale", v_scale, vshape), ("v_zero", v_zero, vshape)):
            if t is None or t.dtype != torch.float16 or tuple(t.shape) != shape:
                raise ValueError(f"{name} must be float16 {shape}, got {None if t is None else (t.dtype, tuple(t.shape))}")
            if t.stride(3) != 1:
                raise ValueError(f"{name}: the last dim must be contiguous")
        if k_scale.stride() != k_zero.stride() or v_scale.stride() != v_zero.stride():
            raise ValueError("k_scale/k_zero (and v_scale/v_zero) must have the same strides")

    if keep is not None and n:
        if keep_block < 1:
            raise ValueError(f"keep needs keep_block >= 1 (tokens per quant-mask block), got {keep_block}")
        rows = _cdiv(n, keep_block) * _cdiv(keep_block, 8)
        if keep.dtype != torch.uint8 or keep.dim() != 3 or tuple(keep.shape[:2]) != (bsz, h) or keep.shape[2] < rows:
            raise ValueError(f"keep must be uint8 (B={bsz}, H={h}, >= {rows}), got {keep.dtype} {tuple(keep.shape)}")
        if keep.stride(2) != 1:
            raise ValueError("keep: the last dim must be contiguous")
    if pool is not None:
        _check_fp(pool[:2], bsz, h, d, "pool")
        slots = pool[2]  # (B, H, P) int32 positions
        if slots.dtype != torch.int32 or tuple(slots.shape) != tuple(pool[0].shape[:3]) or slots.stride(2) != 1:
            raise ValueError(f"pool positions must be int32 {tuple(pool[0].shape[:3])} with a contiguous last dim, "
                             f"got {slots.dtype} {tuple(slots.shape)}")

    # ---- code paths (decided once per layout / dtype / config / device: no per-step Python cost)
    fp_all = fp + ([pool[:2]] if pool is not None else [])
    # without fp segments their (unreached) code still shapes the kernel's register allocation: a
    # float32 fp branch made the packed loop of a window-less call (a PATS tier store) 1.3x slower
    fp_dtype = fp_all[0][0].dtype if fp_all else q.dtype
    if fp_all and any(s[0].dtype != fp_dtype for s in fp_all):
        raise ValueError("the full-precision segments (and the outlier pool) must share a dtype")
    interp = _interpreting()
    layout = (d, rep, k_bits, v_bits, k_group, v_group, k_axis, q.dtype, fp_dtype, dev.type, dev.index or 0)
    plan = _plan(*layout, config, interp)

    # ---- work split
    f_lens = [s[0].shape[2] for s in fp_all]  # sinks, window, pool (those present)
    rule = _split_rule(config)
    # 8-bit blocks cost more: shorter blocks below min_programs programs, not half of it (Mistral
    # shape, batch 1 / 4k, 8-bit 12.0 -> 10.6 us)
    few = rule.min_programs if max(k_bits, v_bits) == 8 else rule.min_programs // 2
    if (n and config.num_splits is None and SMALL_BLOCK_N < plan.block_n and bsz * h * _cdiv(n, plan.block_n) < few
            and (k_axis != "channel" or k_group % SMALL_BLOCK_N == 0)):
        # few rows and a short cache: shorter blocks give more split programs (Qwen2.5-1.5B shape,
        # batch 1, 2-bit: 4k 8.5 -> 7.5 us); planned again, so the lane unpack is verified for the
        # block in use (its register order depends on the tile: with two warps a 64-token check
        # passed where 32-token blocks were wrong)
        plan = _plan(*layout, _with_block_n(config, SMALL_BLOCK_N), interp)
    splits, split_size, chunks, s_tot = _split_plan(n, plan.block_n, f_lens, plan.fp_block, bsz, h, dev, rule)
    if plan.k_halves and splits and split_size <= plan.block_n:
        # one block per split: one group per block where that gives the splits more programs and
        # leaves few enough partials to merge (HALVES_SPLIT_GAIN, HALVES_MAX_SPLITS: Mistral shape
        # batch 1 / 4k 10.8 -> 9.9 us without halves, Qwen shape batch 1 / 16k kept them, 11.8 us)
        single = _plan(*layout, config, interp, halves=False)
        split = _split_plan(n, single.block_n, f_lens, single.fp_block, bsz, h, dev, rule)
        if HALVES_SPLIT_GAIN * splits <= split[0] <= HALVES_MAX_SPLITS:
            plan = single
            splits, split_size, chunks, s_tot = split
    if s_tot == 0:
        return None
    (k_unpack, v_unpack, dot_t, ieee, block_n, k_fold, v_fold, v_chunks, r_pad, fp_t, fp_ieee, fp_block,
     k_halves) = plan

    # ---- arguments (dummies where a part is absent; their code is never reached)
    dummy8 = _dummy(dev, torch.uint8)
    dummy16 = _dummy(dev, torch.float16)
    # key groups per block as virtual row sets (1 with halves: two groups, one per half)
    k_sub = block_n // _pow2_divisor(k_group, block_n) if (k_fold and not k_halves) else 1
    if n:
        kc, ks, kz, vc, vs, vz = k_codes, k_scale, k_zero, v_codes, v_scale, v_zero
        # value codes as int16 units of two bytes where the lane unpack folds them: a 16-bit tile
        # reaches the value MMA by ldmatrix.trans, a byte tile by one shared-memory load per byte
        # (Mistral shape batch 8 / 32k 2-bit 107.8 -> 99.6 us); not with two key groups per block,
        # nor a value mean without a permutation (both measured slower with units); >= 16 units per
        # value group's tile (tl.dot's N; a value mean with chunks accumulates apart anyway)
        v_units = (v_fold and v_unpack in (5, 6) and d * plane_bits(v_bits) // 8 >= 32 * v_chunks
                   and k_sub == 1 and (v_mean is None or v_perm is not None or v_chunks > 1)
                   and vc.stride(3) == 1 and vc.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in vc.stride()[:3]))
        if v_units:
            vc = vc.view(torch.int16)
        elif v_unpack == 5 and v_bits == 3:
            v_unpack = three_bit_byte_unpack(d)
        kcs, kss, vcs, vss = kc.stride()[:3], ks.stride()[:3], vc.stride()[:3], vs.stride()[:3]
    else:
        kc = vc = dummy8
        ks = kz = vs = vz = dummy16
        kcs = kss = vcs = vss = (0, 0, 0)
        v_units = False
    # SKVQ permutations and TaDA means of the packed tokens (absent: dummies, code not compiled)
    dummy32 = _dummy(dev, torch.int32)
    kp = _check_perm("k_perm", k_perm, h, d, dev) if (n and k_perm is not None) else dummy32
    vp = _check_perm("v_perm", v_perm, h, d, dev) if (n and v_perm is not None) else dummy32
    means = []
    for name, mean in (("k_mean", k_mean), ("v_mean", v_mean)):
        if n and mean is not None:
            bits, mv, ms, mz = _check_mean(name, mean, bsz, n, d)
            if ms is None:
                ms = mz = dummy16
                mss = (0, 0)
            else:
                mss = (ms.stride(0), ms.stride(2))
            means.append((bits, (mv, ms, mz, mv.stride(0), mv.stride(2), *mss)))
        else:
            means.append((0, (dummy16, dummy16, dummy16, 0, 0, 0, 0)))
    # rotated packed sides: the packed keys score with the query rotated once per call (by each
    # packed split for Walsh-Hadamard, else a launch here), the packed values' accumulators rotate
    # back once per call (in _run: a launch or inside the combine): never a stored token rotated back
    q_packed = rot_v = None
    q_signs, rot_q = dummy32, False
    if n and k_rot is not None:
        k_matrix, k_signs = _check_rot("k_rot", k_rot, h, d, dev)
        if k_signs is not None and is_hadamard(k_matrix):
            # the split kernel rotates the query into this buffer itself (ROT_Q): no launch
            q_packed = torch.empty((bsz, q.shape[1], d), dtype=torch.float32, device=dev)  # (B, Hq, D)
            q_signs, rot_q = k_signs, True
        else:
            q_packed = rotate_query(q, h, (k_matrix, k_signs))  # (B, Hq, D) float32
    if n and v_rot is not None:
        rot_v = _check_rot("v_rot", v_rot, h, d, dev)
    has_range, lo, hi = _packed_range(packed_start, packed_end, bsz, n, dev)
    has_mask, mk, stride_mb = _visibility(mask, bsz, dev)
    segs = _fp_segment_args(fp, fp_pos, f_lens, fp_dtype, dev)
    n_f1 = chunks[0] if fp else 0
    n_f2 = chunks[1] if len(fp) > 1 else 0
    if pool is not None:
        pool_k, pool_v, pool_pos = pool  # (B, H, P, D) x 2, (B, H, P) int32
        pool_args = (pool_k, pool_v, *pool_k.stride()[:3], *pool_v.stride()[:3], pool_k.shape[2], pool_pos,
                     pool_pos.stride(0), pool_pos.stride(1))
    else:
        z = _dummy(dev, fp_dtype)
        pool_args = (z, z, 0, 0, 0, 0, 0, 0, 0, dummy32, 0, 0)
    has_keep = keep is not None and n > 0
    keep_args = (keep, keep.stride(0), keep.stride(1)) if has_keep else (dummy8, 0, 0)
    if softcap:
        qk_scale, cap = float(scaling), float(softcap)
    else:
        qk_scale, cap = float(scaling) * LOG2E, 1.0

    args = (kc, *kcs, ks, kz, *kss,
            vc, *vcs, vs, vz, *vss,
            lo, hi, n,
            mk, stride_mb, int(packed_position),
            *segs[0], *segs[1], *pool_args, *keep_args,
            kp, vp, q_signs, *means[0][1], *means[1][1],
            splits, split_size, n_f1, n_f2,
            qk_scale, cap,
            h)
    # a third pipeline stage for long splits of the plain folded layout at <= 4 bits (_stages)
    deep_layout = (k_fold and k_sub == 1 and v_chunks == 1 and not means[0][0] and not means[1][0]
                   and max(k_bits, v_bits) <= 4)
    # the kernel's planes: a 3-bit side is read as its 2-bit part's planes plus the high part (HI)
    kpb, vpb = plane_bits(k_bits), plane_bits(v_bits)
    stages = _stages(config.num_stages, split_size // block_n if splits else 0, deep_layout)
    whole = bool(_whole_blocks(d, r_pad, kpb, vpb) and n and n % block_n == 0 and split_size % block_n == 0
                 and not has_range and not (has_mask and mask_packed) and not has_keep)
    v_t = _value_products_t(v_units, v_chunks, k_halves, vpb, means[1][0])
    # the kernel's grouped code paths (its KEYS / VALUES / CALL fields: split_kernel.py decodes them,
    # split_fields below reads them back)
    keys = (bool(k_fold) + 2 * bool(k_halves) + 4 * (k_bits == 3) + 8 * (kp is not dummy32) + 16 * k_sub
            + 2048 * three_bit_key_halves(d, k_bits, k_fold, k_halves) + 4096 * means[0][0])
    # value rows at multiples of 8 int16 units that triton cannot see (it specializes strides by 16
    # only): a 3-bit head_dim 128 row is 24 units; told so, the unit tiles load 16 bytes at a time
    # and by cp.async instead of one LDG.U16 per unit (sm_90 loop 2660 -> 1979 SASS instructions; shared
    # 26.8 -> 34.9 KB a program, 6 one-warp programs an SM instead of 8: awaiting a GPU A/B)
    v_row8 = bool(v_units and v_fold and v_chunks == 1 and vcs[2] % 16 != 0 and vcs[2] % 8 == 0)
    values = (bool(v_fold) + 2 * bool(v_units) + 4 * _value_sum_products(vpb, k_sub) + 8 * _early_value_scales(v_bits)
              + 16 * bool(v_t) + 32 * (v_bits == 3) + 64 * (vp is not dummy32) + 128 * v_row8 + 256 * v_chunks
              + 32768 * three_bit_value_pair(v_bits, v_row8) + 65536 * means[1][0])
    call = (bool(has_range) + 2 * bool(has_mask) + 4 * bool(softcap) + 8 * bool(mask_packed) + 16 * has_keep
            + 32 * whole + 64 * rot_q + 256 * max(1, int(keep_block)))
    meta = dict(R=rep, R_PAD=r_pad, D=d, K_BITS=kpb, V_BITS=vpb, K_GROUP=k_group, V_GROUP=v_group,
                K_UNPACK=k_unpack, V_UNPACK=v_unpack, DOT_T=dot_t, IEEE=ieee, FP_T=fp_t, FP_IEEE=fp_ieee,
                BLOCK_N=block_n, FP_BLOCK=fp_block, KEYS=keys, VALUES=values, CALL=call,
                ROT_Q_SCALE=d ** -0.5 if rot_q else 1.0, num_warps=config.num_warps, num_stages=stages)
    return _SplitCall(bsz * h, s_tot, args, meta, splits, q_packed, rot_v)


def split_fields(meta: dict) -> dict:
    """A planned launch's constexprs with the grouped code paths (KEYS, VALUES, CALL) read back into
    one entry per path, under the kernel's names (K_FOLD, V_T, WHOLE, ...): what the tests and
    experiments inspect. The field layout is the kernel's (split_kernel.py, top of the kernel)."""
    k, v, c = meta["KEYS"], meta["VALUES"], meta["CALL"]
    bit = lambda x, i: (x >> i) & 1 == 1  # noqa: E731
    return {**meta, "PK": meta["D"] * meta["K_BITS"] // 8, "PV": meta["D"] * meta["V_BITS"] // 8,
            "K_FOLD": bit(k, 0), "K_HALVES": bit(k, 1), "K_HI": bit(k, 2), "K_PERM": bit(k, 3),
            "K_SUB": (k >> 4) & 127, "K_HSPLIT": bit(k, 11), "K_MEAN": k >> 12,
            "V_FOLD": bit(v, 0), "V_UNITS": bit(v, 1), "V_SUM_DOTS": bit(v, 2), "V_EARLY": bit(v, 3),
            "V_T": bit(v, 4), "V_HI": bit(v, 5), "V_PERM": bit(v, 6), "V_ROW8": bit(v, 7), "V_NCH": (v >> 8) & 127,
            "V_HPAIR": bit(v, 15), "V_MEAN": v >> 16,
            "HAS_RANGE": bit(c, 0), "HAS_MASK": bit(c, 1), "HAS_SOFTCAP": bit(c, 2), "MASK_PACKED": bit(c, 3),
            "HAS_KEEP": bit(c, 4), "WHOLE": bit(c, 5), "ROT_Q": bit(c, 6), "KEEP_BLOCK": c >> 8}


def _combine_rotated_calls(calls: list[_SplitCall]) -> tuple[list[_SplitCall], int]:
    """The calls in partial-column order and how many leading columns hold value accumulators
    the combine rotates back (0: none, every rotated call takes its own launch). Only where the
    calls' rows (batch x kv heads, one cache: the same for all) pass
    :func:`_back_rotation_in_combine`. The combine takes one rotation over one column range: the
    first rotated call's rotation (the same tensors: one cache side has one rotation), the calls
    with it whose columns are all packed splits first, then at most one with full-precision
    chunks after its splits; any other rotated call keeps its launch."""
    first = next((c for c in calls if c.v_rot is not None and c.splits), None)
    if first is None or not _back_rotation_in_combine(first.bh):
        return calls, 0
    rot = first.v_rot

    def joins(c):
        return c.splits and c.v_rot is not None and c.v_rot[0] is rot[0] and c.v_rot[1] is rot[1]
    whole = [c for c in calls if joins(c) and c.s_tot == c.splits]
    mixed = [c for c in calls if joins(c) and c.s_tot != c.splits][:1]
    ordered = whole + mixed
    rest = [c for c in calls if all(c is not o for o in ordered)]
    return ordered + rest, sum(c.splits for c in ordered)


def _run(q: torch.Tensor, calls: list[_SplitCall | None], return_lse: bool, out_dtype=torch.float32):
    """Launch the planned split kernels into one partial buffer (each call its own columns),
    then one combine over all of them: the calls must cover disjoint tokens of one cache.
    Returns (B, Hq, D) ``out_dtype`` (0 where nothing is visible), with ``return_lse`` also the
    rows' log-sum-exp (B, Hq) float32 (-inf there). Rotated value accumulators rotate back inside
    the combine (:func:`_combine_rotated_calls`' range) or by a launch after their split kernel."""
    bsz, hq, d = q.shape
    calls, rot_cols = _combine_rotated_calls([c for c in calls if c is not None])
    s_all = sum(c.s_tot for c in calls)
    m_part, l_part, o_part, out = _partials(bsz, hq, d, s_all, q.device, _check_out_dtype(out_dtype))
    if s_all == 0:
        out.zero_()
        return (out, torch.full((bsz, hq), float("-inf"), device=q.device)) if return_lse else out
    s_off = 0
    for c in calls:
        qp = q if c.q_packed is None else c.q_packed  # (B, Hq, D)
        _SPLIT((c.bh, c.s_tot), (q, q.stride(0), q.stride(1), qp, qp.stride(0), qp.stride(1), m_part, l_part, o_part,
                                 s_all, s_off, *c.args), c.meta)
        if c.v_rot is not None and c.splits and s_off >= rot_cols:
            rotate_back_partials(o_part, bsz, c.bh // bsz, s_off, c.splits, c.v_rot)
        s_off += c.s_tot
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device) if return_lse else None  # (B, Hq)
    if rot_cols:
        _combine_rotated(m_part, l_part, o_part, s_all, out, lse, calls[0].bh // bsz, 0, rot_cols, calls[0].v_rot)
    else:
        _combine(m_part, l_part, o_part, s_all, out, lse)
    return (out, lse) if return_lse else out


_SPLIT = FastLauncher(_decode_split_kernel)


def _check_q(q) -> torch.Tensor:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (torch.float16, torch.bfloat16,
                                                                          torch.float32):
        raise ValueError(f"q must be (B, Hq, D) float16/bfloat16/float32, got "
                         f"{tuple(getattr(q, 'shape', ()))} {getattr(q, 'dtype', type(q))}")
    return q if q.stride(2) == 1 else q.contiguous()


def _check_out_dtype(dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    return dtype


def _launch(q, *args, return_lse: bool = False, out_dtype=torch.float32, **kwargs):
    """One call: :func:`_prepare` then :func:`_run` (split + combine kernels)."""
    q = _check_q(q)
    return _run(q, [_prepare(q, *args, **kwargs)], return_lse, out_dtype)


# ---------------------------------------------------------------- public function

