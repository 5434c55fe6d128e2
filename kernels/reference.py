"""Pure-PyTorch references of the kernels in this package: same signatures, no triton.

Each kernel is tested against its twin here (STYLE habit 1). The references are written for
clarity, not speed: they dequantize the whole packed cache (the kernels never do).

- :func:`decode_attention_reference` <-> :func:`kvcalib_kernels.decode_attention.decode_attention`
- :func:`decode_attention_parts_reference` <->
  :func:`kvcalib_kernels.decode_attention.decode_attention_parts`
- :func:`quantize_pack_keys_reference` <-> :func:`kvcalib_kernels.quant_pack.quantize_pack_keys`
- :func:`quantize_pack_values_reference` <-> :func:`kvcalib_kernels.quant_pack.quantize_pack_values`
- :func:`center_pack_reference` <-> :func:`kvcalib_kernels.quant_pack.center_pack`

The quantization references *are* :mod:`kvcalib.quant.uniform` (the specification of the
packed layout); they are re-exported under the kernel signatures.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcalib.quant.rotation import unrotate
from kvcalib.quant.uniform import (QuantizedTensor, dequantize_keys, dequantize_values,
                                   quantize_dequantize_values, quantize_keys, quantize_values)

__all__ = [
    "decode_attention_parts_reference",
    "decode_attention_reference",
    "decode_attention_reference_in",
    "dequantize_packed",
    "center_pack_reference",
    "merge_parts",
    "quantize_pack_keys_reference",
    "quantize_pack_values_reference",
    "restore_channels",
    "unpack_keep_bits",
    "unrotate_stored",
]


# ---------------------------------------------------------------- decode attention


def dequantize_packed(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, bits: int,
                      group: int, axis: str) -> torch.Tensor:
    """Packed K or V -> float32 ``(B, H, N, D)``.

    ``axis="channel"``: per-channel parameters over groups of ``group`` tokens, scale/zero
    ``(B, H, N // group, D)`` (keys, KIVI). ``axis="token"``: per-token parameters over groups of
    ``group`` channels, scale/zero ``(B, H, N, D // group)`` (values, or per-token keys).
    The names follow :class:`kvcalib.recipe.LayerConfig` ``k_axis``.
    """
    if axis == "channel":
        return dequantize_keys(QuantizedTensor(codes, scale, zero, bits, group, "token"))
    if axis == "token":
        return dequantize_values(QuantizedTensor(codes, scale, zero, bits, group, "channel"))
    raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")


def restore_channels(x: torch.Tensor, perm: torch.Tensor | None, mean) -> torch.Tensor:
    """Stored-order ``x`` (B, H, N, D) float32 -> input channel order, plus the TaDA mean.

    ``perm`` (H, D): stored channel j holds input channel ``perm[h, j]`` (SKVQ); ``mean``: None,
    float16 ``(B, 1, N, D)``, or 8-bit ``(codes uint8 (B, 1, N, D), scale, zero (B, 1, N, 1))``.
    """
    if perm is not None:
        idx = perm.long().to(x.device)[None, :, None, :].expand_as(x)  # (B, H, N, D)
        x = torch.empty_like(x).scatter_(-1, idx, x)
    if mean is None:
        return x
    if isinstance(mean, torch.Tensor):
        return x + mean.float()
    codes, scale, zero = mean
    return x + (codes.float() * scale.float() + zero.float())


def unrotate_stored(x: torch.Tensor, rot) -> torch.Tensor:
    """Stored tokens ``x`` (B, H, N, D) of a rotated side back to the input basis: ``x R^T`` for a
    rotation ``(matrix, signs)`` (:func:`kvcalib.quant.rotation.unrotate`); None: unchanged."""
    return x if rot is None else unrotate(x, *rot)


def _visible(mask: torch.Tensor | None, b: int, pos: int, n: int, device) -> torch.Tensor:
    """(B, n) bool: ``mask[:, pos:pos+n]`` broadcast over the batch, or all True."""
    if mask is None:
        return torch.ones((b, n), dtype=torch.bool, device=device)
    return mask[:, pos:pos + n].to(device=device, dtype=torch.bool).expand(b, n)


def unpack_keep_bits(keep: torch.Tensor, keep_block: int, n: int) -> torch.Tensor:
    """OTT quant masks as the cache stores them -> bool ``(B, H, n)`` (False: the token's packed
    slot is masked out, it lives in the outlier pool).

    ``keep`` uint8 ``(B, H, R)``: per block of ``keep_block`` tokens, ``ceil(keep_block / 8)``
    bytes; token ``t`` of a block is bit ``t % 8`` of the block's byte ``t // 8``
    (:func:`kvcalib.runtime.outlier_pool.pack_keep`).
    """
    per_block = (keep_block + 7) // 8
    t = torch.arange(n, device=keep.device)  # (n,)
    byte = (t // keep_block) * per_block + (t % keep_block) // 8  # (n,)
    bits = (keep.long()[:, :, byte] >> (t % keep_block % 8)) & 1  # (B, H, n)
    return bits.bool()


def _pool_visible(pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Outlier-pool slots ``pos`` int ``(B, H, P)`` (-1 = empty) -> bool ``(B, H, P)``: filled
    and, when ``mask`` (B|1, L) is given, visible at their absolute positions."""
    ok = pos >= 0
    if mask is None:
        return ok
    b, h, p = pos.shape
    m = mask.to(device=pos.device, dtype=torch.bool).expand(b, -1)  # (B, L)
    idx = pos.long().clamp(0, m.shape[1] - 1).reshape(b, h * p)  # (B, H * P)
    return ok & torch.gather(m, 1, idx).reshape(b, h, p)


def decode_attention_reference_in(
    dtype: torch.dtype,
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
    k_mean=None,
    v_mean=None,
    k_rot=None,
    v_rot=None,
    config=None,
    return_lse: bool = False,
):
    """:func:`decode_attention_reference` computed in ``dtype`` (float64 for a "truth", the
    query's dtype for the "same-dtype PyTorch" error that the tolerance rule scales).

    K/V are dequantized exactly in float32, then cast to ``dtype``; scores and ``p @ V`` run in
    ``dtype``, the softmax in float32 (float64 when ``dtype`` is float64).
    Returns float32 ``(B, Hq, D)``.
    """
    del config  # kernel tuning knobs; the reference has none
    b, hq, d = q.shape
    ks, vs, valid = [], [], []
    if k_codes is not None and k_codes.shape[2] > 0:
        n = k_codes.shape[2]
        ks.append(unrotate_stored(restore_channels(dequantize_packed(k_codes, k_scale, k_zero, bits=k_bits,
                                                                     group=k_group, axis=k_axis), k_perm, k_mean),
                                  k_rot))
        vs.append(unrotate_stored(restore_channels(dequantize_packed(v_codes, v_scale, v_zero, bits=v_bits,
                                                                     group=v_group, axis="token"), v_perm, v_mean),
                                  v_rot))
        idx = torch.arange(n, device=q.device)[None, :]  # (1, N)
        lo = torch.zeros(b, dtype=torch.long, device=q.device) if packed_start is None else packed_start.long()
        hi = torch.full((b,), n, dtype=torch.long, device=q.device) if packed_end is None else packed_end.long()
        ok = (idx >= lo[:, None]) & (idx < hi[:, None])  # (B, N)
        ok = ok & _visible(mask if mask_packed else None, b, packed_position, n, q.device)  # (B, N)
        ok = ok[:, None, :].expand(b, k_codes.shape[1], n)  # (B, H, N)
        if keep is not None:
            ok = ok & unpack_keep_bits(keep.to(q.device), keep_block, n)  # (B, H, N)
        valid.append(ok)
    positions = list(fp_positions) or [0] * len(fp_segments)
    for (fk, fv), pos in zip(fp_segments, positions):
        if fk is None or fk.shape[2] == 0:
            continue
        ks.append(fk.float())
        vs.append(fv.float())
        valid.append(_visible(mask, b, pos, fk.shape[2], q.device)[:, None, :].expand(b, fk.shape[1], -1))
    if pool is not None and pool[0].shape[2] > 0:
        pk, pv, ppos = pool  # (B, H, P, D) x 2, (B, H, P)
        ks.append(pk.float())
        vs.append(pv.float())
        valid.append(_pool_visible(ppos, mask if mask_packed else None))  # (B, H, P)
    if not ks:
        empty = torch.zeros((b, hq, d), dtype=torch.float32, device=q.device)  # (B, Hq, D)
        return (empty, torch.full((b, hq), float("-inf"), device=q.device)) if return_lse else empty
    h = ks[0].shape[1]
    r = hq // h
    k = torch.cat(ks, dim=2).to(dtype)  # (B, H, L, D)
    v = torch.cat(vs, dim=2).to(dtype)  # (B, H, L, D)
    ok = torch.cat(valid, dim=2)  # (B, H, L)
    qq = q.reshape(b, h, r, d).to(dtype)  # (B, H, R, D)
    s = torch.einsum("bhrd,bhld->bhrl", qq, k) * scaling  # (B, H, R, L) in dtype
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    s = s.to(soft)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~ok[:, :, None, :], float("-inf"))
    any_ok = ok.any(dim=2)[:, :, None, None]  # (B, H, 1, 1): rows with nothing visible -> 0
    p = torch.softmax(torch.where(any_ok, s, torch.zeros_like(s)), dim=-1)
    p = torch.where(any_ok, p, torch.zeros_like(p)).to(dtype)
    out = torch.einsum("bhrl,bhld->bhrd", p, v)  # (B, H, R, D)
    if return_lse:
        lse = torch.logsumexp(s, dim=-1)  # (B, H, R): -inf where nothing is visible
        return out.reshape(b, hq, d).float(), lse.reshape(b, hq).float()
    return out.reshape(b, hq, d).float()


def decode_attention_reference(
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
    k_mean=None,
    v_mean=None,
    k_rot=None,
    v_rot=None,
    config=None,
    return_lse: bool = False,
):
    """One decode step of attention over packed K/V plus full-precision segments, in float32.

    Args (shapes; B batch, Hq query heads, H kv heads, D head_dim, N packed tokens):
        q: ``(B, Hq, D)``, any float dtype; ``Hq % H == 0`` (GQA: query head ``h * R + r``
            reads kv head ``h``).
        k_codes: uint8 ``(B, H, N, D * k_bits / 8)``, planar packing (kvcalib.quant.packing);
            None (with the other packed tensors) when nothing is packed.
        k_scale, k_zero: float16; ``k_axis="channel"``: ``(B, H, N / k_group, D)``;
            ``k_axis="token"``: ``(B, H, N, D / k_group)``.
        v_codes: uint8 ``(B, H, N, D * v_bits / 8)``; v_scale, v_zero float16
            ``(B, H, N, D / v_group)``.
        scaling: softmax scale (usually ``D ** -0.5``); softcap: ``softcap * tanh(s / softcap)``.
        packed_start, packed_end: int ``(B,)``: packed tokens ``[start_b, end_b)`` are valid
            (left padding / ragged batches); default all N.
        packed_position: absolute position of packed token 0 (indexes ``mask``).
        fp_segments: up to two full-precision ``(k, v)`` pairs ``(B, H, F, D)`` (sinks and the
            pending window), at absolute positions ``fp_positions``.
        mask: bool ``(B|1, L)`` over absolute positions; False = not visible (padding).
        mask_packed: False: ``mask`` covers the full-precision segments only (every packed token
            is visible, and ``L`` need not reach the packed positions).
        keep, keep_block: OTT quant masks, uint8 ``(B, H, R)`` in the cache's layout (blocks of
            ``keep_block`` tokens, :func:`unpack_keep_bits`); a 0 bit masks that kv head's packed
            slot out (the token lives in the pool). None = every slot counts.
        pool: OTT outlier pools ``(k, v, positions)``: ``(B, H, P, D)`` full precision and int
            ``(B, H, P)`` absolute positions, -1 = empty slot; a filled slot is visible where
            ``mask`` is at its position (when ``mask_packed``: pool tokens come from the packed
            range).
        k_perm, v_perm: int ``(H, D)`` SKVQ channel permutations of the packed sides (stored
            channel j holds input channel ``perm[h, j]``); None = stored in input order.
        k_mean, v_mean: TaDA per-token means over the kv heads, added back after un-permuting:
            float16 ``(B, 1, N, D)`` or 8-bit ``(codes uint8 (B, 1, N, D), scale, zero float16
            (B, 1, N, 1))``; None = not centred.
        k_rot, v_rot: per-head orthogonal rotations of the packed sides, ``(matrix (D, D) |
            (H, D, D), signs (H, D) | None)`` float32: the stored tokens are ``x R``
            (:mod:`kvcalib.quant.rotation`), rotated back after the mean is added; None = unrotated.

    Returns float32 ``(B, Hq, D)``; a row that sees no token is 0. ``return_lse``: also each
    row's log-sum-exp of its (scaled, softcapped) scores over the visible tokens, float32
    ``(B, Hq)`` in natural-log units, -inf where nothing is visible (what merging calls over
    disjoint parts of one cache needs, e.g. one call per PATS tier).
    """
    return decode_attention_reference_in(
        torch.float32, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits=k_bits,
        v_bits=v_bits, k_group=k_group, v_group=v_group, k_axis=k_axis, scaling=scaling,
        softcap=softcap, packed_start=packed_start, packed_end=packed_end,
        packed_position=packed_position, fp_segments=fp_segments, fp_positions=fp_positions,
        mask=mask, mask_packed=mask_packed, keep=keep, keep_block=keep_block, pool=pool, k_perm=k_perm,
        v_perm=v_perm, k_mean=k_mean, v_mean=v_mean, k_rot=k_rot, v_rot=v_rot, config=config,
        return_lse=return_lse)


def merge_parts(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over disjoint parts of a cache from each part's result: ``parts`` of (out
    (B, Hq, D) float32, normalised over the part; lse (B, Hq), its log-sum-exp, -inf when the
    part saw nothing). Returns (B, Hq, D) float32; 0 where no part saw anything."""
    lse = torch.stack([part_lse for _, part_lse in parts])  # (S, B, Hq)
    top = lse.max(dim=0).values  # (B, Hq)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight = torch.exp(lse - top)  # (S, B, Hq): 0 for a part that saw nothing
    total = weight.sum(dim=0)  # (B, Hq)
    out = (weight[..., None] * torch.stack([o for o, _ in parts])).sum(dim=0)  # (B, Hq, D)
    return out / torch.where(total > 0, total, torch.ones_like(total))[..., None]


def decode_attention_parts_reference(q: torch.Tensor, parts, *, config=None, return_lse: bool = False):
    """Attention over a cache stored as disjoint parts (e.g. PATS tier stores): each part (a
    mapping of :func:`decode_attention_reference`'s arguments after ``q``, the packed tensors by
    name, None or absent when the part has none) attended with its log-sum-exp, the parts merged
    exactly (:func:`merge_parts`). Returns float32 ``(B, Hq, D)`` [and the rows' log-sum-exp]."""
    del config
    absent = dict.fromkeys(("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"))  # no packed tokens
    results = [decode_attention_reference(q, **{**absent, **part}, return_lse=True) for part in parts]
    if not results:
        b, hq, d = q.shape
        empty = torch.zeros((b, hq, d), dtype=torch.float32, device=q.device)  # (B, Hq, D)
        return (empty, torch.full((b, hq), float("-inf"), device=q.device)) if return_lse else empty
    out = merge_parts(results)  # (B, Hq, D)
    if not return_lse:
        return out
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in results]), dim=0)  # (B, Hq)
    return out, lse


# ---------------------------------------------------------------- quantize and pack


def _centred_permuted(x: torch.Tensor, perm: torch.Tensor | None, mean: torch.Tensor | None) -> torch.Tensor:
    """``x`` (B, H, T, D) minus TaDA's stored ``mean`` (float32 (B, 1, T, D)), then channels in
    stored order: stored channel j of head h = input channel ``perm[h, j]`` (SKVQ)."""
    if mean is not None:
        x = x.float() - mean  # (B, H, T, D) deviations from the stored mean
    if perm is not None:
        x = torch.gather(x, -1, perm.long().to(x.device)[:, None, :].expand(x.shape))  # (B, H, T, D)
    return x


def quantize_pack_keys_reference(k: torch.Tensor, bits: int, group: int, clip=1.0,
                                 valid: torch.Tensor | None = None, *, perm: torch.Tensor | None = None,
                                 mean: torch.Tensor | None = None) -> QuantizedTensor:
    """Per-channel keys over groups of ``group`` tokens, after TaDA's ``mean`` and SKVQ's ``perm``
    (:func:`kvcalib.quant.uniform.quantize_keys`; the runtime codec's ``quantize_reference``).

    k ``(B, H, T, D)`` -> codes uint8 ``(B, H, T, D * bits / 8)``, scale/zero float16
    ``(B, H, T / group, D)``.
    """
    return quantize_keys(_centred_permuted(k, perm, mean), bits, group, clip=clip, valid=valid)


def quantize_pack_values_reference(v: torch.Tensor, bits: int, group: int, clip=1.0,
                                   valid: torch.Tensor | None = None, *, perm: torch.Tensor | None = None,
                                   mean: torch.Tensor | None = None) -> QuantizedTensor:
    """Per-token values over groups of ``group`` channels, after ``mean`` and ``perm``
    (:func:`kvcalib.quant.uniform.quantize_values`; the runtime codec's ``quantize_reference``).

    v ``(B, H, T, D)`` -> codes uint8 ``(B, H, T, D * bits / 8)``, scale/zero float16
    ``(B, H, T, D / group)``.
    """
    return quantize_values(_centred_permuted(v, perm, mean), bits, group, clip=clip, valid=valid)


def center_pack_reference(x: torch.Tensor, mean_bits: int):
    """TaDA's stored mean over kv heads of ``x`` (B, H, N, D): ``(mean_hat, mean16, mean_q)`` as
    the runtime codec's ``center_reference`` returns it. ``mean_hat`` float32 (B, 1, N, D) is the
    stored mean dequantized; ``mean_bits == 16``: ``mean16`` float16 (B, 1, N, D) is what is
    stored; ``8``: ``mean_q`` holds 8-bit per-token codes of ``mean_hat`` over one group of D."""
    mean = x.float().mean(dim=1, keepdim=True)  # (B, 1, N, D)
    if mean_bits == 16:
        mean_hat = mean.to(torch.float16).float()
        return mean_hat, mean_hat.to(torch.float16), None
    if mean_bits != 8:
        raise ValueError(f"mean_bits must be 8 or 16, got {mean_bits!r}")
    mean_hat = quantize_dequantize_values(mean, 8, mean.shape[-1])  # (B, 1, N, D)
    return mean_hat, None, quantize_values(mean_hat, 8, mean_hat.shape[-1])
