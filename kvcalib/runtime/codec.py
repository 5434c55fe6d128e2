"""How one layer turns a block of full-precision K/V into packed storage and back.

The codec is the single place that knows a layer's quantization layout; the cache stores what it
returns and the attention reads blocks back through it. Fitted state from the recipe enters here:
clip scales (SKVQ), channel permutations (SKVQ reordering: channels permuted before quantizing
so similar channels share a group, un-permuted on decode) and mean-centering across kv heads
(TaDA: the per-token mean over heads stored once at 8 or 16 bits, deviations quantized).

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


class LayerCodec:
    """Quantize/dequantize blocks for one layer according to its LayerConfig and fitted state.

    ``k_clip``/``v_clip``: clip scale alpha in (0, 1] (float or tensor broadcastable to the
    per-group scale shape), fitted offline (SKVQ); 1.0 = no clipping.
    """

    def __init__(self, cfg: LayerConfig, k_clip: float | torch.Tensor = 1.0,
                 v_clip: float | torch.Tensor = 1.0, k_perm: torch.Tensor | None = None,
                 v_perm: torch.Tensor | None = None, k_center: int = 0, v_center: int = 0) -> None:
        self.cfg = cfg
        self.clip = {"k": k_clip, "v": v_clip}
        self.perm = {"k": k_perm, "v": v_perm}  # (H, D) int64: stored channel j = input channel perm[h, j]
        self.inv = {s: (None if p is None else invert_perm(p)) for s, p in self.perm.items()}
        self.center = {"k": int(k_center), "v": int(v_center)}  # mean bits: 0 off, 8 or 16

    def _bits_group(self, side: str) -> tuple[int, int]:
        cfg = self.cfg
        return (cfg.k_bits, cfg.k_group) if side == "k" else (cfg.v_bits, cfg.v_group)

    def _encode(self, side: str, x: torch.Tensor, valid: torch.Tensor | None) -> PackedBlock:
        """x (B, H, N, D) -> PackedBlock: centre, permute, clip-quantize."""
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
        m = None if valid is None else valid[:, None, :]  # (B, 1, N)
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

    # -- keys
    def encode_keys(self, k: torch.Tensor, valid: torch.Tensor | None = None) -> PackedBlock:
        """k (B, H, N, D) -> packed block; ``valid`` (B, N) bool excludes padding from ranges."""
        return self._encode("k", k, valid)

    def decode_keys(self, block: PackedBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed block -> (B, H, N, D) in ``dtype`` (original channel order, mean added back)."""
        return self._decode("k", block, dtype)

    # -- values
    def encode_values(self, v: torch.Tensor, valid: torch.Tensor | None = None) -> PackedBlock:
        """v (B, H, N, D) -> packed block (per token over channel groups)."""
        return self._encode("v", v, valid)

    def decode_values(self, block: PackedBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._decode("v", block, dtype)

    # -- fake quantization (simulation): the values decoding would see, (B, H, N, D) float32
    def roundtrip_keys(self, k: torch.Tensor) -> torch.Tensor:
        return self.decode_keys(self.encode_keys(k), _out_dtype(k))

    def roundtrip_values(self, v: torch.Tensor) -> torch.Tensor:
        return self.decode_values(self.encode_values(v), _out_dtype(v))


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (exactness tests); everything else decodes to float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
