"""The pieces of the fixed-width decode-attention op (public functions in
:mod:`kvcalib_kernels.decode_attention`), shared in part with the Huffman kernel:

- :mod:`.common`: helpers of both kernels (float products, soft cap, full-precision chunks, checks);
- :mod:`.unpack`: packed codes -> float16 operands (device helpers);
- :mod:`.split_kernel`: the split kernel (one partial per split program);
- :mod:`.combine`: the merge of the partials (kernel and launcher);
- :mod:`.rotation`: the query rotation and the accumulators' rotation back of a rotated side;
- :mod:`.splits`: the split-K work division of both kernels;
- :mod:`.plan`: the split kernel's launcher: :class:`~.plan.DecodeConfig`, the per-layout rules,
  argument checks, the lane-unpack check on the device.
"""
