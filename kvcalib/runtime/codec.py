"""How one layer turns a block of full-precision K/V into packed storage and back.

The codec is the single place that knows a layer's quantization layout; the cache stores what it
returns and the attention reads blocks back through it. Fitted state from the recipe enters here:
clip scales (SKVQ), channel permutations (SKVQ reordering: channels permuted before quantizing
so similar channels share a group, un-permuted on decode), mean-centering across kv heads
(TaDA: the per-token mean over heads stored once at 8 or 16 bits, deviations quantized), the
OTT outlier pool size (``outlier_pool``; the cache holds the pools, the codec quantizes each
group with the pool entrants excluded from its ranges: ``keep``), and the PATS tiers
(``schedule``: which bits a stored block holds as it ages; :meth:`LayerCodec.requantize` moves a
block down, :meth:`LayerCodec.roundtrip_tiers` is what the simulation sees at every tier).

Packed layout (the PyTorch reference the Triton kernels follow):

- keys, ``k_axis="channel"``: codes (B, H, N, D*kb/8) uint8 planar-packed along channels;
  scale/zero (B, H, N/k_group, D) float16, one per channel per group of k_group tokens.
- keys, ``k_axis="token"``: codes as above; scale/zero (B, H, N, D/k_group) float16.
- values: codes (B, H, N, D*vb/8); scale/zero (B, H, N, D/v_group) float16.
- 16 bits: the block is kept as it came (model dtype), (B, H, N, D).

Encoding runs the fused Triton kernels (:mod:`kvcalib_kernels.quant_pack`: centering, permutation,
clip, padding and OTT range masks in one pass per side, no device sync) when the backend selection
of :mod:`kvcalib.runtime.backend` picks Triton for the block's tensor (:func:`use_triton_encode`)
and the kernels cover the side's layout (``kvcalib_kernels.quant_pack.supports``); otherwise, and
for PATS requantization, the PyTorch reference below (:func:`center_reference`,
:func:`quantize_reference`), which is the specification: both give the same bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvcalib.quant.uniform import (QuantizedTensor, dequantize, dequantize_keys, dequantize_values,
                                   quantize_keys, quantize_values)
from kvcalib.calibrate.reorder import apply_perm, invert_perm
from kvcalib.calibrate.schedule import Schedule, requantize
from kvcalib.errors import KvcalibError
from kvcalib.recipe import LayerConfig


@dataclass
class PackedBlock:
    """One side (K or V) of a flushed block: a QuantizedTensor, or raw full-precision values,
    plus the stored per-token mean over heads when the side is centred."""

    quantized: QuantizedTensor | None
    raw: torch.Tensor | None  # (B, H, N, D) when not quantized
    mean: torch.Tensor | None = None  # (B, 1, N, D) float16 when centred (16-bit mean)
    mean_q: QuantizedTensor | None = None  # (B, 1, N, D) as 8-bit per-token codes (8-bit mean)

    def nbytes(self) -> int:
        n = int(self.quantized.nbytes()) if self.quantized is not None else int(self.raw.numel() * self.raw.element_size())  # type: ignore[union-attr]
        if self.mean is not None:
            n += int(self.mean.numel() * self.mean.element_size())
        if self.mean_q is not None:
            n += int(self.mean_q.nbytes())
        return n


def _range_mask(valid: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor | None:
    """Tokens that set a group's range: ``valid`` (B, N) padding mask and/or ``keep`` (B, H, N)
    OTT quant mask -> bool broadcastable to (B, H, N), or None (every token)."""
    m = None if valid is None else valid[:, None, :]  # (B, 1, N)
    if keep is not None:
        m = keep if m is None else m & keep  # (B, H, N)
    return m


def center_reference(x: torch.Tensor, mean_bits: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None, QuantizedTensor | None]:
    """TaDA's stored mean of ``x`` (B, H, N, D): ``(mean_hat, mean16, mean_q)``.

    ``mean_hat`` float32 (B, 1, N, D) is the stored mean dequantized (the deviations are taken
    from it); ``mean_bits == 16``: ``mean16`` float16 (B, 1, N, D) is what is stored; ``8``:
    ``mean_q`` holds 8-bit per-token codes of ``mean_hat`` over one group of D channels. The
    specification of :func:`kvcalib_kernels.quant_pack.center_pack`.
    """
    from kvcalib.calibrate.center import center

    mean_hat, _ = center(x, mean_bits)  # (B, 1, N, D) as stored
    if mean_bits == 16:
        return mean_hat, mean_hat.to(torch.float16), None
    return mean_hat, None, quantize_values(mean_hat, 8, mean_hat.shape[-1])


def quantize_reference(x: torch.Tensor, bits: int, group: int, per_channel: bool,
                       clip: float | torch.Tensor = 1.0, valid: torch.Tensor | None = None, *,
                       perm: torch.Tensor | None = None, mean: torch.Tensor | None = None) -> QuantizedTensor:
    """``x`` (B, H, N, D) centred on ``mean`` (float32 (B, 1, N, D), from :func:`center_reference`),
    channels permuted by ``perm`` ((H, D): stored channel j = input channel perm[h, j]), then
    quantized: keys per channel over groups of ``group`` tokens (``per_channel``) or per token over
    groups of ``group`` channels, ranges over ``valid`` (bool, broadcastable to (B, H, N)). The
    specification of :func:`kvcalib_kernels.quant_pack.quantize_pack_keys` / ``..._values``
    (same ``perm`` and ``mean`` arguments)."""
    if mean is not None:
        x = x.float() - mean  # (B, H, N, D) deviations from the stored mean
    if perm is not None:
        x = apply_perm(x, perm)
    return (quantize_keys if per_channel else quantize_values)(x, bits, group, clip=clip, valid=valid)


def use_triton_encode(x: torch.Tensor) -> bool:
    """Whether blocks of ``x`` (B, H, N, D) encode through the Triton kernels: the backend choice
    attention uses (:func:`kvcalib.runtime.backend.triton_chosen`, ``KVCALIB_BACKEND``).
    ``reference``: never; ``auto``: CUDA tensors when triton imports; ``triton``: CUDA tensors, or
    any under ``TRITON_INTERPRET=1`` (the CPU tests), else the reference (like
    :mod:`kvcalib.runtime.triton_path`). No device sync."""
    from kvcalib.runtime.backend import triton_chosen

    if not triton_chosen(x):
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class LayerCodec:
    """Quantize/dequantize blocks for one layer according to its LayerConfig and fitted state.

    ``k_clip``/``v_clip``: clip scale alpha in (0, 1] (float or tensor broadcastable to the
    per-group scale shape), fitted offline (SKVQ); 1.0 = no clipping.
    ``outlier_pool``: OTT pool size P (0 = off); the cache keeps the pools.
    ``schedule``: PATS tiers (None = every block stays at the config's bits); it must agree with
    the config (:meth:`~kvcalib.calibrate.schedule.Schedule.check_layer`).
    """

    def __init__(self, cfg: LayerConfig, k_clip: float | torch.Tensor = 1.0,
                 v_clip: float | torch.Tensor = 1.0, k_perm: torch.Tensor | None = None,
                 v_perm: torch.Tensor | None = None, k_center: int = 0, v_center: int = 0,
                 outlier_pool: int = 0, schedule: Schedule | None = None) -> None:
        self.cfg = cfg
        self.clip = {"k": k_clip, "v": v_clip}
        self.perm = {"k": k_perm, "v": v_perm}  # (H, D) int64: stored channel j = input channel perm[h, j]
        self.inv = {s: (None if p is None else invert_perm(p)) for s, p in self.perm.items()}
        self.center = {"k": int(k_center), "v": int(v_center)}  # mean bits: 0 off, 8 or 16
        self._on_device: dict[tuple[str, str, torch.device], object] = {}  # kernel-path copies
        if isinstance(outlier_pool, bool) or not isinstance(outlier_pool, int) or outlier_pool < 0:
            raise KvcalibError(f"outlier_pool must be a non-negative int (0 = off), got {outlier_pool!r}")
        if outlier_pool and not cfg.compressed:
            raise KvcalibError(f"an outlier pool ({outlier_pool}) needs a compressed layer; this layer keeps "
                               "K and V at 16 bits: set the pool to 0")
        self.outlier_pool = outlier_pool
        if schedule is not None:
            if not isinstance(schedule, Schedule):
                raise KvcalibError(f"schedule must be a Schedule, got {type(schedule).__name__}")
            schedule.check_layer(cfg)  # first quantized tier == config (sinks, window, bits)
            if not cfg.compressed:
                schedule = None  # nothing is ever stored packed: the schedule has nothing to act on
        self.schedule = schedule
        # stored tiers, youngest first: (first age, k_bits, v_bits); one entry without a schedule
        if schedule is None:
            self.tiers = [(cfg.window, cfg.k_bits, cfg.v_bits)]
        else:
            first = next(i for i, t in enumerate(schedule.tiers) if t.quantized)
            self.tiers = [(t.age, t.k_bits, t.v_bits) for t in schedule.tiers[first:]]

    @property
    def tiered(self) -> bool:
        """Whether stored blocks move to fewer bits as they age (more than one stored tier)."""
        return len(self.tiers) > 1

    def _bits_group(self, side: str) -> tuple[int, int]:
        cfg = self.cfg
        return (cfg.k_bits, cfg.k_group) if side == "k" else (cfg.v_bits, cfg.v_group)

    def _encode(self, side: str, x: torch.Tensor, valid: torch.Tensor | None,
                keep: torch.Tensor | None = None) -> PackedBlock:
        """x (B, H, N, D) -> PackedBlock: centre, permute, clip-quantize (ranges over
        :func:`_range_mask`'s tokens); through the Triton kernels where they cover the side
        (:func:`use_triton_encode`), else the reference (same bytes)."""
        bits, group = self._bits_group(side)
        if bits >= 16:
            return PackedBlock(None, x)
        per_channel = side == "k" and self.cfg.k_axis == "channel"
        m = _range_mask(valid, keep)  # (B, 1|H, N) or None
        if use_triton_encode(x):
            out = self._encode_triton(side, x, m, bits, group, per_channel)
            if out is not None:
                return out
        mean = mean16 = mean_q = None
        if self.center[side]:
            mean, mean16, mean_q = center_reference(x, self.center[side])  # (B, 1, N, D)
        q = quantize_reference(x, bits, group, per_channel, self.clip[side], m, perm=self.perm[side], mean=mean)
        return PackedBlock(q, None, mean16, mean_q)

    def _encode_triton(self, side: str, x: torch.Tensor, m: torch.Tensor | None, bits: int, group: int,
                       per_channel: bool) -> PackedBlock | None:
        """:meth:`_encode` through :mod:`kvcalib_kernels.quant_pack` (validate=False: no device
        sync); None when the kernels do not cover this side's layout."""
        from kvcalib_kernels import quant_pack

        perm = self.perm[side]
        if quant_pack.supports(shape=tuple(x.shape), dtype=x.dtype, bits=bits, group=group, per_channel=per_channel,
                               center=self.center[side], perm_heads=None if perm is None else perm.shape[0]) is not None:
            return None
        if perm is not None and perm.shape[-1] != x.shape[-1]:
            return None  # the reference names the mismatch
        mean = mean16 = mean_q = None
        if self.center[side]:
            mean, mean16, mean_q = quant_pack.center_pack(x, self.center[side], validate=False)  # (B, 1, N, D)
        quantize = quant_pack.quantize_pack_keys if per_channel else quant_pack.quantize_pack_values
        q = quantize(x, bits, group, self._device_clip(side, x.device), m,
                     perm=self.device_perm(side, x.device), mean=mean, validate=False)
        return PackedBlock(q, None, mean16, mean_q)

    def _device_clip(self, side: str, device: torch.device) -> float | torch.Tensor:
        """The side's clip alpha on ``device`` as float32, checked and copied once per device (a
        host-to-device copy at every flush would stall it)."""
        clip = self.clip[side]
        if not isinstance(clip, torch.Tensor):
            return clip
        key = ("clip", side, device)
        if key not in self._on_device:
            a = clip.detach().to(dtype=torch.float32)
            if not bool(((a > 0) & (a <= 1)).all()):  # once: the kernels run with validate=False
                raise ValueError(f"{side} clip values must lie in (0, 1] (1 means no clipping)")
            self._on_device[key] = a.to(device)
        return self._on_device[key]  # type: ignore[return-value]

    def device_perm(self, side: str, device: torch.device) -> torch.Tensor | None:
        """The side's permutation on ``device`` as int32 (H, D), copied once per device (the
        quantize-and-pack and decode-attention kernels read it); None when not permuted."""
        perm = self.perm[side]
        if perm is None:
            return None
        key = ("perm", side, device)
        if key not in self._on_device:
            self._on_device[key] = perm.to(device=device, dtype=torch.int32).contiguous()
        return self._on_device[key]  # type: ignore[return-value]

    def _decode(self, side: str, block: PackedBlock, dtype: torch.dtype) -> torch.Tensor:
        if block.raw is not None:
            return block.raw.to(dtype)
        per_channel_keys = side == "k" and self.cfg.k_axis == "channel"
        out = (dequantize_keys if per_channel_keys else dequantize_values)(block.quantized)  # (B, H, N, D)
        if self.inv[side] is not None:
            out = apply_perm(out, self.inv[side])
        if block.mean is not None:
            out = out + block.mean.float()
        elif block.mean_q is not None:
            out = out + dequantize_values(block.mean_q)
        return out.to(dtype)

    def requantize(self, side: str, block: PackedBlock, bits: int, valid: torch.Tensor | None = None,
                   keep: torch.Tensor | None = None) -> PackedBlock:
        """A stored block's side at fewer ``bits`` (PATS tier move), same layout, groups, mean and
        permutation: :func:`~kvcalib.calibrate.schedule.requantize` on the codes, with the same
        range mask as at the first quantization (``valid`` (B, N), ``keep`` (B, H, N))."""
        if block.quantized is None:
            raise KvcalibError(f"the {side} side is stored at 16 bits: a schedule cannot requantize it")
        qt, m = block.quantized, _range_mask(valid, keep)
        q = self._requantize_triton(qt, bits, m) if use_triton_encode(qt.codes) else None
        if q is None:
            q = requantize(qt, bits, valid=m)
        return PackedBlock(q, None, block.mean, block.mean_q)

    @staticmethod
    def _requantize_triton(qt, bits: int, m: torch.Tensor | None):
        """:func:`~kvcalib.calibrate.schedule.requantize` with the quantize-and-pack kernel for the
        second step (the same bytes: the kernels are bit-exact with the reference quantizers):
        dequantize in torch, then quantize the stored-order values at ``bits``, no clip. None when
        the kernels do not cover the layout. A tier move at a flush was ~2 ms per layer and side in
        torch on an H200 (most of a PATS flush at 32k)."""
        from kvcalib_kernels import quant_pack

        if isinstance(bits, bool) or bits not in (2, 4, 8) or bits >= qt.bits:
            return None  # the reference names the problem
        per_channel = qt.axis == "token"  # keys per channel over token groups
        x = dequantize(qt)  # (B, H, T, D) float32, stored channel order
        if quant_pack.supports(shape=tuple(x.shape), dtype=x.dtype, bits=bits, group=qt.group,
                               per_channel=per_channel) is not None:
            return None
        quantize = quant_pack.quantize_pack_keys if per_channel else quant_pack.quantize_pack_values
        return quantize(x, bits, qt.group, 1.0, m, validate=False)

    # -- keys
    def encode_keys(self, k: torch.Tensor, valid: torch.Tensor | None = None,
                    keep: torch.Tensor | None = None) -> PackedBlock:
        """k (B, H, N, D) -> packed block; ``valid`` (B, N) bool excludes padding from ranges,
        ``keep`` (B, H, N) bool excludes OTT pool entrants (False) per kv head."""
        return self._encode("k", k, valid, keep)

    def decode_keys(self, block: PackedBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed block -> (B, H, N, D) in ``dtype`` (original channel order, mean added back)."""
        return self._decode("k", block, dtype)

    # -- values
    def encode_values(self, v: torch.Tensor, valid: torch.Tensor | None = None,
                      keep: torch.Tensor | None = None) -> PackedBlock:
        """v (B, H, N, D) -> packed block (per token over channel groups); masks as encode_keys."""
        return self._encode("v", v, valid, keep)

    def decode_values(self, block: PackedBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._decode("v", block, dtype)

    # -- fake quantization (simulation): the values decoding would see, (B, H, N, D) float32
    def roundtrip_keys(self, k: torch.Tensor) -> torch.Tensor:
        return self.decode_keys(self.encode_keys(k), _out_dtype(k))

    def roundtrip_values(self, v: torch.Tensor) -> torch.Tensor:
        return self.decode_values(self.encode_values(v), _out_dtype(v))

    def roundtrip_tiers(self, side: str, x: torch.Tensor, keep: torch.Tensor | None = None) -> list[torch.Tensor]:
        """What decoding sees of ``x`` (B, H, N, D) (whole flush blocks) at each stored tier:
        one tensor (B, H, N, D) per entry of :attr:`tiers`, reached as the cache reaches it --
        encoded at the first tier's bits, then requantized at every tier whose bits for this side
        are lower (PATS's chain, ``Schedule.bits_chain``). ``keep`` (B, H, N): OTT quant mask."""
        dtype = _out_dtype(x)
        blk = self._encode(side, x, None, keep)
        bits = self._bits_group(side)[0]
        out = [self._decode(side, blk, dtype)]
        for _, kb, vb in self.tiers[1:]:
            new = kb if side == "k" else vb
            if new < bits:
                blk, bits = self.requantize(side, blk, new, None, keep), new
                out.append(self._decode(side, blk, dtype))
            else:
                out.append(out[-1])
        return out


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (exactness tests); everything else decodes to float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
