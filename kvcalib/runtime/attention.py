"""The attention entry point over a :class:`~kvcalib.runtime.cache.CompressedLayer`, registered
with transformers' ``AttentionInterface`` as ``"kvcalib"``.

A key tensor returned by ``CompressedLayer.update`` carries its layer (:data:`LAYER_ATTR`); the
attention runs over everything the layer holds -- the fused kernels on CUDA for decode steps
(:mod:`kvcalib.runtime.backend`), the reference (:mod:`kvcalib.runtime.reference`, their
specification) otherwise -- and after attending tells the layer to flush: the prompt's own
attention runs over full-precision prompt K/V, and only then is the prompt compressed.
"""

from __future__ import annotations

import math

import torch

from kvcalib.runtime.reference import visible_mask

ATTN_NAME = "kvcalib"
LAYER_ATTR = "_kvcalib_layer"  # attribute on the key tensor returned by CompressedLayer.update()


def kvcalib_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      softcap=None, **kwargs):
    """AttentionInterface function: compressed attention when ``key`` comes from a
    CompressedLayer, otherwise plain SDPA (e.g. a forward without a cache)."""
    layer = getattr(key, LAYER_ATTR, None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, softcap=softcap, **kwargs)
    from kvcalib.runtime.backend import decode_attention

    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if layer.graph_owned:  # an eager decode step run as a per-layer static step (runtime/layer_graphs.py)
        out = layer.graphs.attend(layer, query, key, value, scale, softcap)
        if out is not None:
            return out, None  # (B, 1, Hq, D) in the query's dtype
        # the kernel does not cover the layer: it took the token in dynamically, go on below
    elif layer.static is not None:  # a static (CUDA-graph) step: the device state says what is visible
        return decode_attention(query, layer, None, scale, softcap, path="static").to(query.dtype), None
    tq = query.shape[-2]
    if attention_mask is None:  # nothing is padding (and no host sync per layer)
        visible = None
        layer.commit()
    else:
        visible = visible_mask(attention_mask, layer, tq, query.device)  # (B|1, Tq, KV)
        steps = torch.arange(tq, device=visible.device)
        # a real token sees itself, padding nothing (also through a sliding window): which of the
        # step's tokens are real, (B|1, Tq)
        real = visible[:, steps, visible.shape[-1] - tq + steps]
        layer.commit(real, _host_rows(attention_mask, real, layer.n_seen))
    # no mask and no padding: a decode step's query sees every cached token (the kernel then
    # reads no mask at all, and none is built unless the reference path runs); a padded batch's
    # rows are decided one by one (decode_attention splits them)
    all_visible = visible is None and not layer.is_sliding and tq == 1
    out = decode_attention(query, layer, visible, scale, softcap, all_visible=all_visible)
    layer.flush()
    return out.to(query.dtype), None


def _host_rows(attention_mask: torch.Tensor, real: torch.Tensor, seen: int) -> list[list[bool]]:
    """``real.tolist()``, kept on the mask tensor: the layers of one forward share their mask (and
    so which of the step's tokens are real), so a padded batch's decode step copies it to the host
    once, not once per layer (each copy waits for the GPU's queue). Keyed by the tokens seen and
    the shape, which a later forward changes."""
    key = (seen, tuple(real.shape))
    memo = getattr(attention_mask, "_kvcalib_real", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    rows = real.tolist()
    attention_mask._kvcalib_real = (key, rows)
    return rows


def register() -> None:
    """Register ``"kvcalib"`` attention and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, kvcalib_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)


def use_kvcalib_attention(model) -> None:
    """Switch ``model`` to kvcalib attention (falls back to SDPA where no compressed cache is used)."""
    register()
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
