"""Quantization core: planar bit packing and asymmetric uniform (KIVI-layout) quantization.

These are the PyTorch reference implementations that every Triton kernel is tested against
bit for bit. Pure torch: importing this package pulls in no triton and initialises no CUDA.
"""

from kvcalib.quant.packing import (
    pack_2bit_u8,
    pack_3bit_u8,
    pack_4bit_u8,
    pack_8bit_u8,
    pack_codes,
    packed_width,
    unpack_2bit_u8,
    unpack_3bit_u8,
    unpack_4bit_u8,
    unpack_8bit_u8,
    unpack_codes,
)
from kvcalib.quant.uniform import (
    QuantizedTensor,
    dequantize,
    dequantize_keys,
    dequantize_values,
    quantize_dequantize_keys,
    quantize_dequantize_values,
    quantize_keys,
    quantize_values,
)

__all__ = [
    "QuantizedTensor",
    "dequantize",
    "dequantize_keys",
    "dequantize_values",
    "pack_2bit_u8",
    "pack_3bit_u8",
    "pack_4bit_u8",
    "pack_8bit_u8",
    "pack_codes",
    "packed_width",
    "quantize_dequantize_keys",
    "quantize_dequantize_values",
    "quantize_keys",
    "quantize_values",
    "unpack_2bit_u8",
    "unpack_3bit_u8",
    "unpack_4bit_u8",
    "unpack_8bit_u8",
    "unpack_codes",
]
