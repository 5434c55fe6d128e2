"""kvcalib_kernels: Triton kernels for kvcalib's compressed KV cache (installed from ``kernels/``).

One op per module, each laid out kernel -> launcher -> public function, each with a pure-PyTorch
twin of the same signature in :mod:`kvcalib_kernels.reference` that it is tested against:

- :mod:`kvcalib_kernels.decode_attention`: split-K flash-decoding over packed 2/4/8-bit K
  (per-channel or per-token scales) and V (per-token scales), all query heads of a GQA group
  in one program, the full-precision segments (sinks, window, OTT outlier pool) merged by
  log-sum-exp, OTT quant masks skipping the pool entrants' packed slots.
- :mod:`kvcalib_kernels.quant_pack`: quantize-and-pack a flushed block (with the recipe's
  permutation, clip, OTT keep mask and TaDA mean; ``center_pack`` stores the mean), bit-exact
  with :func:`kvcalib.codec.quantize_reference` / ``center_reference``.

:mod:`kvcalib_kernels.launch` (no kernel of its own) launches a compiled kernel again without
Triton's per-call argument binding, for the decode kernels' eager host time.

Importing this package (or :mod:`kvcalib_kernels.reference`) imports no triton and initialises
no CUDA: the kernel modules import triton themselves, on first import. On a machine without a
GPU, set ``TRITON_INTERPRET=1`` *before* importing a kernel module to run it in Triton's
interpreter (that is how ``tests/kernels`` run on CPU).
"""
