"""Adapter from a :class:`~kvcalib.runtime.cache.CompressedLayer` to the fused decode kernel.

:func:`triton_decode_attention` returns None whenever the kernel does not cover the case, and
the caller (:func:`kvcalib.runtime.backend.decode_attention`) then runs the PyTorch reference
:func:`kvcalib.runtime.reference.attend_compressed`, which is the specification. Covered:

- one query token per sequence (decode steps, ``Tq == 1``);
- CUDA tensors (or any device under ``TRITON_INTERPRET=1``, for the CPU tests);
- a compressed layer with both K and V at 2, 3, 4 or 8 bits (a 16-bit side returns None), keys per
  channel or per token, the group sizes :func:`kvcalib_kernels.decode_attention.supports` takes;
- global and sliding-window layers: a layer whose window sits in its fixed buffer (every
  compressed layer between prompts) is launched exactly as a static step launches it -- the
  whole buffer under the visibility a static step computes
  (:meth:`~kvcalib.runtime.cache.CompressedLayer.decode_visibility`; the caller's ``visible``
  says nothing more: the layer holds no padding and a decode query sees every real token,
  through the window on a sliding layer) -- so the two modes run one computation; otherwise
  what the query may see comes from ``visible`` (its last query row, over absolute positions).
  A padded batch runs one launch per row over the row's own layer
  (:attr:`~kvcalib.runtime.cache.CompressedLayer.rows`), split by
  :func:`kvcalib.runtime.backend.decode_attention`, the one place that splits rows: the
  functions here take one unpadded layer -- or, where the rows join in shared allocations
  (:mod:`kvcalib.runtime.joint`), one launch over all of them (:func:`joint_decode_attention`,
  which takes the joint and one row, never the layer's rows). A sliding layer has already dropped
  its packed blocks older than the window at the last flush
  (:meth:`~kvcalib.runtime.cache.CompressedLayer.flush`), so the packed tokens the kernel reads
  span at most the window plus one flush block, the mask hiding
  the stale rest (and any pending or sink tokens the window no longer shows). In static
  (CUDA-graph) mode the visibility lives on the device (:mod:`kvcalib.runtime.static`: one mask
  per window size, refreshed inside the captured step).

- SKVQ channel permutations (``{k|v}.perm``: the kernel reads the query at each stored key
  channel's input channel and writes value channels back to their input positions) and TaDA
  centering (``{k|v}.center``, 8- or 16-bit per-token means: ``q . mean`` joins each score and
  ``sum p * mean`` the output, inside the same pass);
- OTT outlier pools (``kv.outlier_pool`` > 0): each kv head's packed slots of pool entrants are
  skipped through the stored quant masks (read as bits inside the loop), and the pool and extra
  pool (full precision, at their own absolute positions, -1 = empty) are one more segment;
- PATS tiers (a ``kv.schedule`` with more than one stored tier): the packed tokens live in one
  store per bit width and the split kernel reads one bit width per launch, so a tiered layer is
  one split launch per non-empty store (the first also takes the sinks, window and pools), all
  writing one partial buffer that a single combine merges
  (:func:`kvcalib_kernels.decode_attention.decode_attention_parts`; exact: the parts are disjoint).

Not covered (the reference runs that layer; other layers still use the kernel): 16-bit sides,
layouts :func:`kvcalib_kernels.decode_attention.supports` refuses.

Segments passed to the kernel, by absolute position: sinks ``[0, S)`` (unless dropped), packed
tokens ``[view.start, view.start + n)``, pending full-precision tokens ``[pend_start, n_seen)``,
the outlier pools at their positions. Nothing is copied: the packed parts are views of the
layer's growable buffers, the pools the layer's joined pool tensors. A stable-launch layer
(:attr:`~kvcalib.runtime.cache.CompressedLayer.stable_launch`) passes its packed store's whole
allocation with the live range on the device, and its window buffer at the virtual position ``S``
under its own mask, so its launch does not change at a flush.

Importing this module imports triton (through kvcalib_kernels.decode_attention) on first use
of :func:`triton_decode_attention` only.
"""

from __future__ import annotations

import logging
import os

import torch

from kvcalib.runtime.store import packed_view

log = logging.getLogger(__name__)

_PACKED_BITS = (2, 3, 4, 8)


def _reason_unsupported(query: torch.Tensor, layer) -> str | None:
    """Why the kernel cannot run this step (None: it can). Cheap: no device sync, and kept on the
    layer per query signature (nothing it reads changes once the layer holds tokens), so a decode
    step pays one tuple comparison instead of the checks (host time is what eager steps are short of)."""
    interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    key = (query.shape, query.dtype, query.device, interp)
    memo = layer.__dict__.get("_kernel_reason")
    if memo is not None and memo[0] == key:
        return memo[1]
    why = _check_supported(query, layer, interp)
    if getattr(layer, "is_initialized", False):
        layer._kernel_reason = (key, why)
        if (why is not None and why not in _STEP_REASONS and layer.cfg.compressed
                and not layer.__dict__.get("_reference_said")):
            # a compressed layout the kernel does not read: its decode steps run the PyTorch
            # reference, many times slower; said once per layer (not per step, not for a prompt
            # pass, not for a layer kept in full precision)
            layer._reference_said = True
            log.warning("layer %s decodes on the PyTorch reference path, not the fused kernel: %s",
                        getattr(layer, "layer_idx", "?"), why)
    return why


# reasons that belong to the step, not to the layer's layout (nothing to tell the user)
_STEP_REASONS = ("not a single-token decode step", "not a CUDA tensor", "layer not initialised")


def _check_supported(query: torch.Tensor, layer, interp: bool) -> str | None:
    b, hq, tq, d = query.shape
    if tq != 1:
        return "not a single-token decode step"
    if not (query.is_cuda or interp):
        return "not a CUDA tensor"
    if not getattr(layer, "is_initialized", False):
        return "layer not initialised"
    return kernel_reason(layer.cfg, layer.codec, d, layer.sink_k.shape[1], hq, query.device)


def kernel_reason(cfg, codec, head_dim: int, kv_heads: int, q_heads: int,
                  device: torch.device | str = "cpu") -> str | None:
    """Why the fused kernel cannot decode a layer of this config and method states (None: it
    can), from the layout alone: no tokens, no device kernel run. ``codec`` is the layer's
    :class:`~kvcalib.codec.LayerCodec`; ``device`` where its method states' kernel arguments are
    built (their shapes, not their values, matter here)."""
    if not cfg.compressed or cfg.k_bits not in _PACKED_BITS or cfg.v_bits not in _PACKED_BITS:
        return "layer is not packed on both K and V"
    d, h, hq = head_dim, kv_heads, q_heads
    for side in ("k", "v"):
        attend = codec.kernel_attend(side, torch.device(device))  # a KernelAttend
        if attend is None:  # name the states the kernel cannot apply (levels, 8-bit pairs, pre-RoPE keys...)
            dev = torch.device(device)
            names = [name for name, state in codec.states.items() if state.kernel_attend(side, dev) is None]
            return f"the kernel does not apply the {side} side's {', '.join(names) or 'method'} state"
        perm = attend.perm
        if perm is not None and tuple(perm.shape) != (h, d):
            return f"{side} permutation of shape {tuple(perm.shape)} for {h} kv heads of {d} channels"
    if hq % h:
        return "query heads not a multiple of kv heads"
    from kvcalib_kernels.decode_attention import supports

    for _, k_bits, v_bits in codec.tiers:  # the config's bits, then each PATS tier's
        if k_bits not in _PACKED_BITS or v_bits not in _PACKED_BITS:
            return f"a PATS tier at K{k_bits}/V{v_bits} is not packed on both K and V"
        why = supports(head_dim=d, k_bits=k_bits, v_bits=v_bits, k_group=cfg.k_group, v_group=cfg.v_group,
                       k_axis=cfg.k_axis, rep=hq // h)
        if why is not None:
            return why
    return None


def decode_paths(recipe, info) -> list[str | None]:
    """Per layer of ``recipe`` on the model ``info`` describes, why its decode steps take the
    PyTorch reference path on a GPU (None: the fused kernel decodes it). From the recipe's layout
    and method states alone (:func:`kernel_reason`); what ``kvcalib inspect`` and the search report
    show beside each layer. Where Triton is not installed every layer says so."""
    try:
        import kvcalib_kernels.decode_attention  # noqa: F401  (triton)
    except ImportError as err:  # no triton on this platform: the reference path is all it has
        return [f"the fused kernels need triton ({err.name or err})"] * info.num_layers
    return [kernel_reason(cfg, codec, info.head_dim, info.num_kv_heads, info.num_q_heads)
            for cfg, codec in zip(recipe.layer_configs(info.num_layers), recipe.codecs(info))]


def triton_decode_attention(query: torch.Tensor, layer, visible: torch.Tensor, scaling: float,
                            softcap: float | None = None, all_visible: bool = False) -> torch.Tensor | None:
    """Fused attention of ``query`` (B, Hq, 1, D) over ``layer``; (B, 1, Hq, D) in the query's dtype
    (the combine kernel rounds its float32 merge once at the store: no cast kernel), or None.

    ``visible`` (B|1, 1, KV) bool over absolute positions ``0..n_seen-1`` (False = padding);
    ``all_visible``: it is True everywhere (and may be None), so no mask is passed to the kernel.
    Returns None (use the reference) when the step or the layer is not covered (module doc).
    ``layer`` is one unpadded layer: a padded batch's rows come one by one, through
    :func:`kvcalib.runtime.backend.decode_attention` (a ragged layer raises).
    """
    layer.require_dense("the fused decode kernel")
    if _reason_unsupported(query, layer) is not None:
        return None
    if layer.pend_buffered:  # the very launch a static step makes (static_decode_attention): one computation
        mask, mask_packed = layer.decode_visibility()  # (1, L): a dense layer's query sees every real token
        return _launch_layer(query, layer, (layer.pend_buf_k, layer.pend_buf_v), mask, mask_packed, scaling, softcap)
    pending = (layer.pend_k, layer.pend_v)  # (B, H, U, D) x 2
    mask = None if all_visible else visible[:, -1, :]  # (B|1, KV)
    return _launch_layer(query, layer, pending, mask, True, scaling, softcap)


def static_decode_attention(query: torch.Tensor, layer, scaling: float,
                            softcap: float | None = None) -> torch.Tensor:
    """The same over a layer in static mode (:mod:`kvcalib.runtime.static`): the whole pending
    buffer is passed and ``layer.static.visible`` hides its empty slots (and padding), so the
    launch is the same at every step between two flushes. Raises when the kernel does not cover
    the layer (there is no reference fallback inside a CUDA graph). One unpadded layer, as
    :func:`triton_decode_attention` (a padded batch: ``backend.decode_attention(path="static")``)."""
    from kvcalib.errors import KvcalibError

    layer.require_dense("the fused decode kernel")
    why = _reason_unsupported(query, layer)
    if why is not None:
        raise KvcalibError(f"layer {layer.layer_idx} cannot decode in static (CUDA-graph) mode: {why}; "
                           "decode without CUDA graphs")
    state = layer.static
    pending = (layer.pend_buf_k, layer.pend_buf_v)  # (B, H, window + block, D) x 2
    if layer.is_sliding:  # its own device mask (the window's lower bound), read for every segment
        out = _launch_layer(query, layer, pending, state.window_visible(layer.sliding_window), True, scaling, softcap)
    elif layer.static_mask is not None:  # stable launch: its own mask over its virtual positions (cache.py)
        out = _launch_layer(query, layer, pending, layer.static_mask, False, scaling, softcap)
    else:  # a static layer holds no padding: the mask only hides the buffer's empty slots
        out = _launch_layer(query, layer, pending, state.visible, False, scaling, softcap)
    if out is None:
        raise KvcalibError(f"layer {layer.layer_idx} stores a 16-bit side raw: static (CUDA-graph) mode needs "
                           "packed K and V")
    return out


def joint_decode_attention(query: torch.Tensor, joint, row, mask: torch.Tensor, scaling: float,
                           softcap: float | None = None) -> torch.Tensor | None:
    """Fused attention of ``query`` (B, Hq, 1, D) over a padded batch's rows joined in shared
    allocations (:class:`~kvcalib.runtime.joint.JointRows`), in one launch; (B, 1, Hq, D) in the
    query's dtype, or None when the kernel does not cover the rows' layout (``row``: one of them,
    whose config and codec they all share). ``mask`` (B, S + U) bool: each row's visibility over
    the virtual positions (sinks, then the window buffer). Called by
    :func:`kvcalib.runtime.backend.decode_attention` (the one place rows are split or joined)."""
    if _reason_unsupported(query[:1], row) is not None:
        return None
    from kvcalib_kernels.decode_attention import decode_attention_parts

    part = joint.kernel_part
    if part is None:
        part = _joint_part(joint, row, query.device)
    segments = [(joint.sink_k, joint.sink_v), (joint.pend_k, joint.pend_v)]  # (B, H, S, D), (B, H, U, D)
    positions = [0, joint.sinks]
    if not joint.sinks:  # a recipe without sinks (KIVI): no empty segment
        segments, positions = segments[1:], positions[1:]
    call = dict(part, scaling=scaling, softcap=softcap, fp_segments=segments, fp_positions=positions,
                mask=mask, mask_packed=False, pool=None)
    return decode_attention_parts(query[:, :, 0, :], [call], out_dtype=query.dtype)[:, None]


def _joint_part(joint, row, device) -> dict:
    """The packed arguments of a joint launch: the shared allocation read whole, each row's live
    tokens ``[lo, hi)`` on the device, the rows' (shared) codec's method arguments."""
    store = row.packed.stores[0]
    view = packed_view(row.cfg, joint.sinks, joint.capacity, joint.parts)  # positions are read through the masks
    part = dict(_view_part(view, store.bits, row.cfg, row.codec, device), packed_start=joint.lo, packed_end=joint.hi)
    joint.kernel_part = part
    return part


def _launch_layer(query, layer, pending, mask, mask_packed, scaling, softcap) -> torch.Tensor | None:
    """Kernel calls over ``layer``: sinks, packed tokens (one call per non-empty PATS store),
    ``pending`` (B, H, U, D) K/V, the OTT pools."""
    from kvcalib_kernels.decode_attention import decode_attention_parts

    cfg = layer.cfg
    codec = layer.codec
    # a stable-launch layer's window sits at its virtual position, right after the sinks (cache.py)
    stable = layer.stable_launch and pending[0] is layer.pend_buf_k
    segments, positions = [], []
    if layer.sink_k.shape[2] and not layer.sinks_dropped:
        segments.append((layer.sink_k, layer.sink_v))  # (B, H, S, D)
        positions.append(0)
    if pending[0].shape[2]:
        segments.append(pending)  # (B, H, U, D)
        positions.append(layer.sink_k.shape[2] if stable else layer.pend_start)
    pool = layer.outliers.segment(segments[0][0].dtype if segments else query.dtype)  # or None
    stores = [store for store in layer.packed.stores if store.n] or layer.packed.stores[:1]  # oldest tier last
    parts = []
    for i, store in enumerate(stores):
        base = _store_part(store, cfg, codec, query.device, stable)
        if base is None:
            return None  # a 16-bit side stored raw: not this kernel's layout
        first = i == 0  # the full-precision parts join the first part only
        parts.append(dict(
            base, scaling=scaling, softcap=softcap, fp_segments=segments if first else (),
            fp_positions=positions if first else (), mask=mask, mask_packed=mask_packed,
            pool=pool if first else None))
    # one split launch per store into one partial buffer, one combine: (B, Hq, D) in the query's dtype
    return decode_attention_parts(query[:, :, 0, :], parts, out_dtype=query.dtype)[:, None]


def _store_part(store, cfg, codec, device, whole: bool = False) -> dict | None:
    """The kernel arguments of one packed store that change only when it does (a flush): its
    tensors, bits, layout, permutations, means and OTT masks; None when a side is stored raw.
    Kept on the store beside the view they come from, so a decode step rebuilds nothing.
    ``whole``: read the store's whole allocation, the live range on the device (a stable-launch
    layer: then the arguments change only when the store is reallocated)."""
    view = store.capacity_view() if whole else None
    whole = view is not None
    if not whole:
        view = store.view()  # the same object until the store changes
    cached = store.kernel_part
    if cached is not None and cached[0] is view and cached[1] == device:
        if whole and view.n:
            store.device_range()  # the live count as the host has it (also after a restore set ``n``)
        return cached[2]
    part = _view_part(view, store.bits, cfg, codec, device)
    if part is None:
        return None
    if whole and "k_codes" in part:  # the whole allocation: its live tokens [0, n) on the device
        part["packed_start"], part["packed_end"] = store.device_range()
    store.kernel_part = (view, device, part)
    return part


def _view_part(view, bits: dict, cfg, codec, device) -> dict | None:
    """The kernel arguments of a :class:`~kvcalib.runtime.store.PackedView` at ``bits`` (side ->
    width): its tensors, layout, permutations, means and OTT masks; None when a side is stored raw."""
    packed = dict(k_codes=view.k_codes, k_scale=view.k_scale, k_zero=view.k_zero, v_codes=view.v_codes,
                  v_scale=view.v_scale, v_zero=view.v_zero)
    if view.n == 0 or any(t is None for t in packed.values()):
        if view.n:
            return None
        packed = {}
    part = dict(packed, k_bits=bits["k"], v_bits=bits["v"], k_group=cfg.k_group,
                v_group=cfg.v_group, k_axis=cfg.k_axis, packed_position=view.start, keep=view.keep,
                keep_block=cfg.flush_block, k_mean=view.k_mean, v_mean=view.v_mean)  # means of an empty store are ignored
    for side in ("k", "v"):  # the method states' kernel arguments (SKVQ permutations, rotations)
        attend = codec.kernel_attend(side, device)  # a KernelAttend (None: refused by kernel_reason before)
        if attend is not None:
            part.update(attend.kernel_args(side))  # the one place it becomes keyword arguments
    return part
