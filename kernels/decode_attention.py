"""Split-K flash-decoding over a packed 2/4/8-bit KV cache (one query token per sequence): the
public functions. The op's pieces live in :mod:`kvcalib_kernels.decode`: code unpacking
(``unpack``), the split kernel (``split_kernel``), the merge (``combine``), the launcher and its
rules (``plan``), the split-K division shared with the Huffman kernel (``splits``).

What one call computes (the specification is
:func:`kvcalib_kernels.reference.decode_attention_reference`): softmax attention of ``q``
``(B, Hq, D)`` over

- N packed tokens: K codes planar-packed along D with per-channel scales over groups of
  ``k_group`` tokens (KIVI keys, ``k_axis="channel"``) or per-token scales over groups of
  ``k_group`` channels (``k_axis="token"``); V codes with per-token scales over groups of
  ``v_group`` channels. Bits 2, 4 or 8 per side (compile-time constants);
- up to two full-precision segments ``(B, H, F, D)`` (the cache's sinks and pending window),
- an OTT outlier pool ``(B, H, P, D)`` at int32 absolute positions ``(B, H, P)`` (-1 = empty),
  with per-kv-head quant masks of the packed slots (the cache's ``keep`` bytes, one bit per
  token in blocks of ``keep_block``; a 0 bit: the token lives in the pool, its slot is skipped),

with a per-batch valid range of packed tokens and an optional visibility mask over absolute
positions (padding). Packed sides may carry an SKVQ channel permutation ``(H, D)`` (the query is
read at each stored key channel's input channel; value channels are stored back at theirs) and a
TaDA per-token mean ``(B, 1, N, D)`` shared by the kv heads, 16-bit or 8-bit codes with per-token
scale/zero (``q . mean`` joins each score, ``sum p * mean`` each value plane, in the same pass),
and a per-head orthogonal rotation ``(matrix, signs)`` (:mod:`kvcalib.quant.rotation`: the stored
tokens are ``x R``): the packed keys are scored with the query rotated once per call (inside
each packed split for the random-sign Walsh-Hadamard rotation, a launch before the split kernel
for a fitted matrix) and the packed values' accumulators are rotated back once per call (a
launch before the merge, or inside it from ``COMBINE_ROTATION_MIN_ROWS`` batch x kv heads rows:
:mod:`kvcalib_kernels.decode.plan`); the full-precision segments are stored unrotated and
attended as they are.

Two launches: the split kernel (grid ``(B * H, packed splits + full-precision chunks)``, each
program a partial ``(m, l, acc)`` for the query heads of one kv head), then the combine
(log-sum-exp merge of each row's partials). :func:`decode_attention_parts` runs one split launch
per stored part (e.g. a PATS tier store), all into one partial buffer, and one combine.

Speed on an H100/H200: ``artifacts/bench/decode_attention.md`` (``benchmarks/``); how the kernel
got there, with the settings that lost: ``artifacts/bench/HISTORY.md``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcalib_kernels.decode.plan import (DEFAULT_CONFIG, DecodeConfig, _check_q, _launch, _prepare, _run,
                                         fast_unpack_available, supports)

__all__ = ["DecodeConfig", "decode_attention", "decode_attention_parts", "supports", "fast_unpack_available"]


def decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_codes: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    *,
    k_bits: int,
    v_bits: int,
    k_group: int,
    v_group: int,
    k_axis: str = "channel",
    scaling: float,
    softcap: float | None = None,
    packed_start: torch.Tensor | None = None,
    packed_end: torch.Tensor | None = None,
    packed_position: int = 0,
    fp_segments: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    fp_positions: Sequence[int] = (),
    mask: torch.Tensor | None = None,
    mask_packed: bool = True,
    keep: torch.Tensor | None = None,
    keep_block: int = 0,
    pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k_perm: torch.Tensor | None = None,
    v_perm: torch.Tensor | None = None,
    k_mean: torch.Tensor | tuple | None = None,
    v_mean: torch.Tensor | tuple | None = None,
    k_rot: tuple | None = None,
    v_rot: tuple | None = None,
    config: DecodeConfig | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.float32,
):
    """Attention of one query token per sequence over a packed + full-precision KV cache.

    Same arguments and result as :func:`kvcalib_kernels.reference.decode_attention_reference`
    (float32 ``(B, Hq, D)``), plus ``config`` (:class:`~kvcalib_kernels.decode.plan.DecodeConfig`,
    tuning only) and
    ``out_dtype`` (float16 / bfloat16: the float32 result rounded once by the combine kernel's
    store, so a caller needs no cast kernel of its own). Runs on CUDA
    tensors, or on CPU tensors under ``TRITON_INTERPRET=1``. Raises ValueError on shapes, dtypes
    or layouts it does not handle (:func:`supports` says which, without raising).
    """
    return _launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits=k_bits, v_bits=v_bits,
                   k_group=k_group, v_group=v_group, k_axis=k_axis, scaling=scaling, softcap=softcap,
                   packed_start=packed_start, packed_end=packed_end, packed_position=packed_position,
                   fp_segments=fp_segments, fp_positions=fp_positions, mask=mask, mask_packed=mask_packed,
                   keep=keep, keep_block=keep_block, pool=pool, return_lse=return_lse, out_dtype=out_dtype,
                   config=config or DEFAULT_CONFIG, k_perm=k_perm, v_perm=v_perm, k_mean=k_mean, v_mean=v_mean,
                   k_rot=k_rot, v_rot=v_rot)


def decode_attention_parts(
    q: torch.Tensor,
    parts: Sequence[Mapping[str, Any]],
    *,
    config: DecodeConfig | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.float32,
):
    """Attention over a cache stored as disjoint parts, e.g. PATS tier stores (each its own bits):
    one split launch per part, all writing one partial buffer, and one combine over all partials
    (no per-part combine, no separate merge).

    ``parts``: one mapping per part with :func:`decode_attention`'s arguments after ``q`` by
    name (``k_codes`` ... ``v_zero`` may be None or absent for a part with no packed tokens).
    Same result as :func:`kvcalib_kernels.reference.decode_attention_parts_reference`
    (``out_dtype`` as in :func:`decode_attention`).
    """
    q = _check_q(q)
    cfg = config or DEFAULT_CONFIG
    calls = []
    for i, part in enumerate(parts):
        unknown = part.keys() - _PART_DEFAULTS.keys() - _PART_REQUIRED
        if unknown:
            raise ValueError(f"part {i}: unknown arguments {sorted(unknown)}")
        missing = _PART_REQUIRED - part.keys()
        if missing:
            raise ValueError(f"part {i}: missing {', '.join(sorted(missing))}")
        calls.append(_prepare(q, **{**_PART_DEFAULTS, **part}, config=cfg))
    return _run(q, calls, return_lse, out_dtype)


_PACKED_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
# what a part may name: decode_attention's arguments after q, less the per-call ones; those with
# a default (the packed tensors: None, a part without packed tokens) and those it must give
_PART_PARAMS = {name: param for name, param in inspect.signature(decode_attention).parameters.items()
                if name not in ("q", "config", "return_lse", "out_dtype")}
_PART_DEFAULTS = {name: None if param.default is param.empty else param.default
                  for name, param in _PART_PARAMS.items() if param.default is not param.empty or name in _PACKED_NAMES}
_PART_REQUIRED = frozenset(_PART_PARAMS) - _PART_DEFAULTS.keys()
