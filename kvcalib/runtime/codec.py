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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcalib.quant.uniform import (QuantizedTensor, dequantize_keys, dequantize_values,
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
        :func:`_range_mask`'s tokens)."""
        bits, group = self._bits_group(side)
        if bits >= 16:
            return PackedBlock(None, x)
        mean = mean_q = None
        if self.center[side]:
            from kvcalib.calibrate.center import center

            mean_f, x = center(x, self.center[side])  # (B, 1, N, D) as stored, (B, H, N, D)
            if self.center[side] == 16:
                mean = mean_f.to(torch.float16)
            else:
                mean_q = quantize_values(mean_f, 8, mean_f.shape[-1])
        if self.perm[side] is not None:
            x = apply_perm(x, self.perm[side])
        m = _range_mask(valid, keep)  # (B, 1|H, N) or None
        per_channel_keys = side == "k" and self.cfg.k_axis == "channel"
        quantize = quantize_keys if per_channel_keys else quantize_values
        return PackedBlock(quantize(x, bits, group, clip=self.clip[side], valid=m), None, mean, mean_q)

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
        q = requantize(block.quantized, bits, valid=_range_mask(valid, keep))
        return PackedBlock(q, None, block.mean, block.mean_q)

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
