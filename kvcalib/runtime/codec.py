"""How one layer turns a block of full-precision K/V into packed storage and back.

The codec is the single place that knows a layer's quantization layout; the cache stores what it
returns and the attention reads blocks back through it. Fitted state from the recipe (clip
scales today; permutations, centering and outliers in later methods) enters here.

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
from kvcalib.recipe import LayerConfig


@dataclass
class PackedBlock:
    """One side (K or V) of a flushed block: a QuantizedTensor, or raw full-precision values."""

    quantized: QuantizedTensor | None
    raw: torch.Tensor | None  # (B, H, N, D) when not quantized

    def nbytes(self) -> int:
        if self.quantized is not None:
            return int(self.quantized.nbytes())
        return int(self.raw.numel() * self.raw.element_size())  # type: ignore[union-attr]


class LayerCodec:
    """Quantize/dequantize blocks for one layer according to its LayerConfig and fitted state.

    ``k_clip``/``v_clip``: clip scale alpha in (0, 1] (float or tensor broadcastable to the
    per-group scale shape), fitted offline (SKVQ); 1.0 = no clipping.
    """

    def __init__(self, cfg: LayerConfig, k_clip: float | torch.Tensor = 1.0,
                 v_clip: float | torch.Tensor = 1.0) -> None:
        self.cfg = cfg
        self.k_clip, self.v_clip = k_clip, v_clip

    # -- keys
    def encode_keys(self, k: torch.Tensor, valid: torch.Tensor | None = None) -> PackedBlock:
        """k (B, H, N, D) -> packed block; ``valid`` (B, N) bool excludes padding from ranges."""
        cfg = self.cfg
        if cfg.k_bits >= 16:
            return PackedBlock(None, k)
        v = None if valid is None else valid[:, None, :]  # (B, 1, N)
        if cfg.k_axis == "channel":
            return PackedBlock(quantize_keys(k, cfg.k_bits, cfg.k_group, clip=self.k_clip, valid=v), None)
        return PackedBlock(quantize_values(k, cfg.k_bits, cfg.k_group, clip=self.k_clip, valid=v), None)

    def decode_keys(self, block: PackedBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed block -> (B, H, N, D) in ``dtype``."""
        if block.raw is not None:
            return block.raw.to(dtype)
        qt = block.quantized
        out = dequantize_keys(qt) if self.cfg.k_axis == "channel" else dequantize_values(qt)
        return out.to(dtype)

    # -- values
    def encode_values(self, v: torch.Tensor, valid: torch.Tensor | None = None) -> PackedBlock:
        """v (B, H, N, D) -> packed block (per token over channel groups)."""
        cfg = self.cfg
        if cfg.v_bits >= 16:
            return PackedBlock(None, v)
        m = None if valid is None else valid[:, None, :]
        return PackedBlock(quantize_values(v, cfg.v_bits, cfg.v_group, clip=self.v_clip, valid=m), None)

    def decode_values(self, block: PackedBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if block.raw is not None:
            return block.raw.to(dtype)
        return dequantize_values(block.quantized).to(dtype)

    # -- fake quantization (simulation): the values decoding would see, (B, H, N, D) float32
    def roundtrip_keys(self, k: torch.Tensor) -> torch.Tensor:
        return self.decode_keys(self.encode_keys(k))

    def roundtrip_values(self, v: torch.Tensor) -> torch.Tensor:
        return self.decode_values(self.encode_values(v))
