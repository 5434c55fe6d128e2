"""Decode-faithful simulation: one teacher-forced forward that scores exactly what token-by-token
decoding through :class:`~kvcalib.runtime.cache.CompressedCache` computes.

In real decoding with a prompt of P tokens, query i sees key j

- in full precision while i < P (the prompt's own attention runs before compression), or j is a
  sink (j < S), or j is not yet flushed;
- otherwise as its quantized value, fixed when j's block was flushed.

The runtime flushes after each attention call, so query i >= P sees the blocks flushed after
i tokens: positions [S, S + n_q(i)) with ``n_q = recipe.quantized_token_count``. Blocks are
quantized from the same consecutive tokens either way, so we precompute every block's quantized
K/V once and pick, per (i, j), full precision or quantized: two score matrices and a mask,
one forward per sequence instead of a token-by-token loop.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from kvcalib.recipe import LayerConfig, quantized_token_count
from kvcalib.runtime.codec import LayerCodec

SIM_ATTN = "kvcalib_sim"


@dataclass
class SimulationState:
    configs: list[LayerConfig]
    codecs: list[LayerCodec]
    sliding: list[int | None]
    prompt_len: int


_STATE: SimulationState | None = None


def quantized_mask(cfg: LayerConfig, t: int, prompt_len: int, device=None) -> torch.Tensor:
    """(T, T) bool: True where query i sees key j quantized (see module docstring)."""
    i = torch.arange(t, device=device)
    nq = torch.tensor([quantized_token_count(cfg, int(x)) for x in range(t)], device=device)  # (T,)
    j = torch.arange(t, device=device)
    quant = (j[None, :] >= cfg.sinks) & (j[None, :] < cfg.sinks + nq[:, None])  # (T, T)
    return quant & (i[:, None] >= prompt_len)


def _simulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         softcap=None, **kwargs):
    """AttentionInterface function for the simulation; query (B, Hq, T, D), key/value (B, H, T, D)."""
    state = _STATE
    layer = int(module.layer_idx)
    cfg, codec = state.configs[layer], state.codecs[layer]
    b, hq, t, d = query.shape
    h = key.shape[1]
    rep = hq // h
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    from kvcalib.runtime.attention import compute_dtype

    acc_dtype = compute_dtype(query.dtype)
    q = query.to(acc_dtype).reshape(b, h, rep, t, d)  # (B, H, rep, T, D)
    k, v = key.to(acc_dtype), value.to(acc_dtype)  # (B, H, T, D)
    if attention_mask is not None:
        vis = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask  # (B|1, T, T)
        if vis.dtype != torch.bool:
            vis = vis > torch.finfo(vis.dtype).min / 2
    else:
        pos = torch.arange(t, device=query.device)
        vis = pos[None, :] <= pos[:, None]
        if state.sliding[layer] is not None:
            vis &= pos[None, :] > pos[:, None] - state.sliding[layer]
        vis = vis[None]
    scores = torch.einsum("bhrtd,bhnd->bhrtn", q, k) * scale  # (B, H, rep, T, T)
    if cfg.compressed:
        nq_total = quantized_token_count(cfg, t)
        if nq_total:
            span = slice(cfg.sinks, cfg.sinks + nq_total)
            k_hat, v_hat = k.clone(), v.clone()
            k_hat[:, :, span] = _blockwise(codec.roundtrip_keys, k[:, :, span], cfg.flush_block).to(acc_dtype)
            v_hat[:, :, span] = _blockwise(codec.roundtrip_values, v[:, :, span], cfg.flush_block).to(acc_dtype)
            qmask = quantized_mask(cfg, t, state.prompt_len, query.device)  # (T, T)
            scores_q = torch.einsum("bhrtd,bhnd->bhrtn", q, k_hat) * scale
            scores = torch.where(qmask, scores_q, scores)
        else:
            qmask = None
    else:
        qmask = None
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~vis[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    if qmask is None:
        out = torch.einsum("bhrtn,bhnd->bhrtd", probs, v)
    else:
        p_q = probs * qmask
        out = torch.einsum("bhrtn,bhnd->bhrtd", probs - p_q, v) + torch.einsum("bhrtn,bhnd->bhrtd", p_q, v_hat)
    out = out.reshape(b, hq, t, d).transpose(1, 2)  # (B, T, Hq, D)
    return out.to(query.dtype), None


def _blockwise(fn, x: torch.Tensor, block: int) -> torch.Tensor:
    """Apply a block quantizer to (B, H, N, D) with N a multiple of ``block`` (blocks independent)."""
    b, h, n, d = x.shape
    if block == 1:
        return fn(x)
    # fold blocks into the batch dim: each block is quantized exactly as the runtime flushes it
    xb = x.reshape(b, h, n // block, block, d).permute(0, 2, 1, 3, 4).reshape(b * (n // block), h, block, d)
    yb = fn(xb)
    return yb.reshape(b, n // block, h, block, d).permute(0, 2, 1, 3, 4).reshape(b, h, n, d)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SIM_ATTN, _simulated_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SIM_ATTN, sdpa_mask)


@contextlib.contextmanager
def simulating(model, configs: list[LayerConfig], codecs: list[LayerCodec] | None = None,
               prompt_len: int = 1) -> Iterator[None]:
    """Within the block, ``model(...)`` (no cache) computes decode-faithful logits."""
    global _STATE
    from kvcalib.models import model_info

    _register()
    info = model_info(model.config, "model")
    previous = model.config._attn_implementation
    _STATE = SimulationState(configs, codecs or [LayerCodec(c) for c in configs],
                             list(info.sliding_window), prompt_len)
    model.set_attn_implementation(SIM_ATTN)
    try:
        yield
    finally:
        _STATE = None
        model.set_attn_implementation(previous)


@torch.no_grad()
def simulated_logits(model, input_ids: torch.Tensor, configs: list[LayerConfig],
                     codecs: list[LayerCodec] | None = None, prompt_len: int = 1) -> torch.Tensor:
    """Logits (B, T, V) (float32, or float64 for a float64 model) of a decode-faithful teacher-forced forward over ``input_ids`` (B, T)."""
    with simulating(model, configs, codecs, prompt_len):
        out = model(input_ids=input_ids, use_cache=False)
    return out.logits.to(torch.float64 if out.logits.dtype == torch.float64 else torch.float32)
