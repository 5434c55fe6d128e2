"""Which attention implementation runs over a compressed layer: the PyTorch reference or the
fused Triton kernels. ``KVCALIB_BACKEND=reference|triton`` forces one; the default picks Triton
for single-token decode steps on CUDA when it is importable, the reference otherwise. Even when
Triton is chosen, a layer the kernel does not cover (a 16-bit side, a layout it refuses:
:mod:`kvcalib.runtime.triton_path`) runs the reference, layer by layer.

:func:`decode_attention` is also the one place a padded batch is split into its rows (a ragged
layer, :attr:`~kvcalib.runtime.cache.CompressedLayer.rows`: cache.py's docstring): every path
below it -- :func:`~kvcalib.runtime.reference.attend_compressed`,
:func:`~kvcalib.runtime.triton_path.triton_decode_attention`,
:func:`~kvcalib.runtime.triton_path.static_decode_attention` -- reads one unpadded layer (and
refuses a ragged one), so how a row's query and visibility are cut out of the batch's, and what a
row alone may skip (the all-visible mask), is decided here once for every path, static
(CUDA-graph) steps included.

One seam for the optional GPU dependency: nothing here imports triton at module import.
"""

from __future__ import annotations

import torch

from kvcalib.accel import requested_backend, triton_chosen

# decode_attention's paths: "auto" the choice above (and a prompt's own attention through SDPA while
# the layer holds nothing compressed); "reference" / "triton" that path alone (the kernel's is None
# where it does not cover the step; tests compare the two); "static" a static (CUDA-graph) step
PATHS = ("auto", "reference", "triton", "static")


def use_triton_for(query: torch.Tensor) -> bool:
    """Attention: :func:`triton_chosen`, and under ``auto`` only for single-token decode steps."""
    if requested_backend() == "auto" and query.shape[-2] != 1:
        return False
    return triton_chosen(query)


def decode_attention(query: torch.Tensor, layer, visible: torch.Tensor | None, scaling: float,
                     softcap: float | None = None, all_visible: bool = False,
                     path: str = "auto") -> torch.Tensor | None:
    """Attention of ``query`` (B, Hq, Tq, D) over ``layer``; returns (B, Tq, Hq, D): the kernel's in
    the query's dtype, the reference's in :func:`~kvcalib.runtime.attention.compute_dtype` (a
    padded batch: the reference's dtype, the query's on ``path="triton"`` and ``"static"``).
    ``visible`` (B|1, Tq, KV) bool, or None: causal (and the layer's sliding window), nothing
    padding; ``all_visible``: it is True everywhere (the kernel skips reading it; ``visible`` is
    then built only if the reference runs). ``path``: :data:`PATHS` (``"static"``: ``visible`` is
    ignored, the layer's device state says what is visible; ``"triton"``: None where the kernel
    does not cover the step).

    A padded batch's layer (``layer.rows``) runs each row over its own unpadded layer, here and
    nowhere else (module docstring): a row's real queries over its ``visible`` slice
    (:meth:`~kvcalib.runtime.cache.CompressedLayer.attend_rows`; a query at padding gets zeros),
    all visible when nothing was passed, the row global and the step a decode step; in static
    mode every row decodes its one token over its own device state (static mode refuses a row
    that ended), concatenated. Rows that can share one launch do instead: a decode step with a
    real token in every row, on the kernel's path, over rows joined in shared allocations
    (:mod:`kvcalib.runtime.joint`; static mode: :attr:`~kvcalib.runtime.cache.CompressedLayer.joint_static`)."""
    if path not in PATHS:
        raise ValueError(f"path {path!r} is not one of {', '.join(PATHS)}")
    rows = layer.rows
    if rows is None:
        return _attend_layer(query, layer, visible, scaling, softcap, all_visible, path)
    if path == "static":
        if layer.joint_static:  # the rows joined: one launch, each row's visibility on the device
            from kvcalib.errors import KvcalibError
            from kvcalib.runtime.triton_path import joint_decode_attention

            out = joint_decode_attention(query, layer.joint, rows[0], layer.static_mask, scaling, softcap)
            if out is None:
                raise KvcalibError(f"layer {layer.layer_idx} cannot decode in static (CUDA-graph) mode: the fused "
                                   "kernel does not read its layout; decode without CUDA graphs")
            return out
        return torch.cat([_attend_layer(query[i:i + 1], row, None, scaling, softcap, False, path)
                          for i, row in enumerate(rows)])  # (B, 1, Hq, D)
    if (query.shape[-2] == 1 and path in ("auto", "triton") and (path == "triton" or use_triton_for(query))
            and all(layer.row_queries(i, 1) is not None for i in range(len(rows)))):
        # a decode step with a real token in every row: the rows joined, one launch (runtime/joint.py)
        joint = layer.joined()
        if joint is not None:
            from kvcalib.runtime.triton_path import joint_decode_attention

            joint.sync_counts()
            out = joint_decode_attention(query, joint, rows[0], joint.visibility(), scaling, softcap)
            if out is not None:
                return out

    def one_row(q: torch.Tensor, row, vis: torch.Tensor | None) -> torch.Tensor | None:
        row_all_visible = vis is None and not row.is_sliding and q.shape[-2] == 1
        return _attend_layer(q, row, vis, scaling, softcap, row_all_visible, path)

    from kvcalib.runtime.reference import compute_dtype

    return layer.attend_rows(query, visible, one_row, query.dtype if path == "triton" else compute_dtype(query.dtype))


def _attend_layer(query: torch.Tensor, layer, visible: torch.Tensor | None, scaling: float,
                  softcap: float | None, all_visible: bool, path: str) -> torch.Tensor | None:
    """:func:`decode_attention` over one unpadded layer, on ``path``."""
    if path == "static":
        from kvcalib.runtime.triton_path import static_decode_attention

        return static_decode_attention(query, layer, scaling, softcap)
    from kvcalib.runtime.reference import attend_compressed, full_precision_prefill, visible_mask

    if path == "auto" and query.shape[-2] > 1 and not softcap:  # a prompt over a layer that holds it in full precision
        out = full_precision_prefill(query, layer, visible, scaling)
        if out is not None:
            return out
    if path == "triton" or (path == "auto" and use_triton_for(query)):
        if visible is None and not all_visible:
            visible = visible_mask(None, layer, query.shape[-2], query.device)  # (1, Tq, KV)
        from kvcalib.runtime.triton_path import triton_decode_attention

        out = triton_decode_attention(query, layer, visible, scaling, softcap, all_visible=all_visible)
        if out is not None or path == "triton":
            return out
    if visible is None:
        visible = visible_mask(None, layer, query.shape[-2], query.device)  # (1, Tq, KV)
    return attend_compressed(query, layer, visible, scaling, softcap)
