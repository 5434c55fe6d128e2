"""Which attention implementation runs over a compressed layer: the PyTorch reference or the
fused Triton kernels. ``KVCALIB_BACKEND=reference|triton`` forces one; the default picks Triton
for single-token decode steps on CUDA when it is importable, the reference otherwise. Even when
Triton is chosen, a layer the kernel does not cover (a 16-bit side, a layout it refuses:
:mod:`kvcalib.runtime.triton_path`) runs the reference, layer by layer.

One seam for the optional GPU dependency: nothing here imports triton at module import.
"""

from __future__ import annotations

import torch

from kvcalib.accel import requested_backend, triton_chosen


def use_triton_for(query: torch.Tensor) -> bool:
    """Attention: :func:`triton_chosen`, and under ``auto`` only for single-token decode steps."""
    if requested_backend() == "auto" and query.shape[-2] != 1:
        return False
    return triton_chosen(query)


def decode_attention(query: torch.Tensor, layer, visible: torch.Tensor, scaling: float,
                     softcap: float | None = None, all_visible: bool = False) -> torch.Tensor:
    """Attention of ``query`` (B, Hq, Tq, D) over ``layer``; returns (B, Tq, Hq, D): the kernel's in
    the query's dtype, the reference's in :func:`~kvcalib.runtime.attention.compute_dtype`.
    ``visible`` (B|1, Tq, KV) bool, or None: causal (and the layer's sliding window), nothing
    padding; ``all_visible``: it is True everywhere (the kernel skips reading it; ``visible`` is
    then built only if the reference runs)."""
    from kvcalib.runtime.reference import attend_compressed, compute_dtype, full_precision_prefill, visible_mask

    if layer.rows is not None:  # padded batch: each row over its own layer (cache.py's docstring)
        def one_row(q, row, vis):
            return decode_attention(q, row, vis, scaling, softcap,
                                    all_visible=vis is None and not row.is_sliding and q.shape[-2] == 1)

        return layer.attend_rows(query, visible, one_row, compute_dtype(query.dtype))
    if query.shape[-2] > 1 and not softcap:  # a prompt over a layer that holds it in full precision
        out = full_precision_prefill(query, layer, visible, scaling)
        if out is not None:
            return out
    if visible is None and not all_visible:
        visible = visible_mask(None, layer, query.shape[-2], query.device)  # (1, Tq, KV)
    if use_triton_for(query):
        from kvcalib.runtime.triton_path import triton_decode_attention

        out = triton_decode_attention(query, layer, visible, scaling, softcap, all_visible=all_visible)
        if out is not None:
            return out
    if visible is None:
        visible = visible_mask(None, layer, query.shape[-2], query.device)  # (1, Tq, KV)
    return attend_compressed(query, layer, visible, scaling, softcap)
