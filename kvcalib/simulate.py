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

OTT (the codec's ``pool_size`` > 0): a flushed token chosen for the pool at its own flush stays
in full precision forever, and one not chosen is quantized forever, per (batch row, kv head);
:func:`~kvcalib.methods.outliers.trace_outliers` (reached through the codec's ``pool`` state) runs
the runtime's flushes over the flushed keys and gives that set. Those tokens are seen in full precision by every query and are left out
of their group's range (the codec's ``keep`` mask), exactly as the cache does.

PATS (the codec's ``schedule``): the cache requantizes, after each step at context T, every block
``[s, e)`` to the tier of age ``T - e``, going through every tier in between. Query i sees the
state left after context i (the same timing as the flushes), so it sees key j at the stored tier
``u`` with ``tiers[u].age <= i - e_j`` (the last such), i.e. ``codec.roundtrip_tiers(...)[u]``: the
first quantization followed by the chain of requantizations. One score matrix per stored tier.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from kvcalib.layout import LayerConfig, quantized_token_count
from kvcalib.codec import LayerCodec

SIM_ATTN = "kvcalib_sim"


@dataclass
class SimulationState:
    configs: list[LayerConfig]
    codecs: list[LayerCodec]
    sliding: list[int | None]
    prompt_len: int


_STATE: SimulationState | None = None


# score elements (batch x query heads x query chunk x keys) per query chunk of the simulation:
# 2**25 float32 = 128 MiB a matrix, a few of them alive at once, so a 32k-token forward of a
# model with 14 query heads runs in chunks of ~70 queries and stays within a few hundred MiB
# per layer instead of the dense (T, T) matrices (56 GiB per layer at 32k)
SCORE_BUDGET = 1 << 25


def packed_counts(cfg: LayerConfig, t: int, device=None) -> torch.Tensor:
    """(T,) int64: tokens in packed storage after ``i`` tokens, for i in 0..T-1
    (:func:`~kvcalib.layout.quantized_token_count`, vectorised)."""
    i = torch.arange(t, device=device)
    if not cfg.compressed:
        return torch.zeros_like(i)
    pending = i - i.clamp(max=cfg.sinks)
    return ((pending - cfg.window).clamp_min(0) // cfg.flush_block) * cfg.flush_block


def quantized_mask(cfg: LayerConfig, t: int, prompt_len: int, device=None, rows: slice | None = None,
                   keys: int | None = None) -> torch.Tensor:
    """(Tq, Tk) bool: True where query i sees key j quantized (see module docstring); queries
    ``rows`` (default all T), keys ``0..keys-1`` (default T)."""
    rows = rows or slice(0, t)
    keys = t if keys is None else keys
    i = torch.arange(rows.start, rows.stop, device=device)  # (Tq,)
    nq = packed_counts(cfg, t, device)[rows]  # (Tq,)
    j = torch.arange(keys, device=device)  # (Tk,)
    quant = (j[None, :] >= cfg.sinks) & (j[None, :] < cfg.sinks + nq[:, None])  # (Tq, Tk)
    return quant & (i[:, None] >= prompt_len)


def stored_tier_index(cfg: LayerConfig, codec: LayerCodec, t: int, device=None, rows: slice | None = None,
                      keys: int | None = None) -> torch.Tensor:
    """(Tq, Tk) int64: the stored tier (index into ``codec.tiers``) in which query i sees key j,
    for keys j that are packed by then (elsewhere meaningless): the last tier whose first age is
    ``<= i - e_j``, ``e_j`` the end of j's flush block (module docstring)."""
    rows = rows or slice(0, t)
    keys = t if keys is None else keys
    block = cfg.flush_block
    i = torch.arange(rows.start, rows.stop, device=device)  # (Tq,)
    j = torch.arange(keys, device=device)  # (Tk,)
    block_end = cfg.sinks + ((j - cfg.sinks).clamp_min(0) // block + 1) * block  # (Tk,) e_j
    age = i[:, None] - block_end[None, :]  # (Tq, Tk)
    ages = torch.tensor([a for a, _, _ in codec.tiers], device=device)  # (U,) increasing
    return (torch.searchsorted(ages, age.contiguous(), right=True) - 1).clamp_min(0)  # (Tq, Tk)


def _simulated_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         softcap=None, **kwargs):
    """AttentionInterface function for the simulation; query (B, Hq, T, D), key/value (B, H, T, D).

    Queries run in chunks (:data:`SCORE_BUDGET`), each over the keys it may see causally, so
    memory grows linearly with T, never with T x T."""
    state = _STATE
    layer = int(module.layer_idx)
    cfg, codec = state.configs[layer], state.codecs[layer]
    b, hq, t, d = query.shape
    h = key.shape[1]
    rep = hq // h
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    from kvcalib.runtime.reference import compute_dtype

    acc_dtype = compute_dtype(query.dtype)
    q = query.to(acc_dtype).reshape(b, h, rep, t, d)  # (B, H, rep, T, D)
    k, v = key.to(acc_dtype), value.to(acc_dtype)  # (B, H, T, D)
    window = state.sliding[layer]
    nq_total = quantized_token_count(cfg, t) if cfg.compressed else 0
    # per stored tier u: K/V as decoding sees them, and which (b, h, key) slots are packed at all
    k_hats: list[torch.Tensor] = []  # U x (B, H, T, D)
    v_hats: list[torch.Tensor] = []
    slot = None  # (B, H, T) bool
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask  # (B|1, T, T)
        if mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
    if nq_total:
        span = slice(cfg.sinks, cfg.sinks + nq_total)
        positions = None  # (B|1, N) RoPE positions of the flushed span, for states that read them
        if codec.needs_positions:
            if mask is not None and window is None:  # the last query sees every real key: padding skipped
                positions = (mask[:, -1, :].long().cumsum(-1) - 1).clamp_min(0)[:, span]
            else:
                positions = torch.arange(span.start, span.stop, device=query.device)[None]
        keep = None  # (B, H, N) OTT quant mask over the flushed span
        if codec.pool_size:
            fp, _ = codec.pool.trace(key[:, :, span], cfg.flush_block, start=cfg.sinks,
                                     v=value[:, :, span])  # (B, H, N): kept in the pool
            keep = ~fp
        k_tiers = _blockwise_tiers(codec, "k", k[:, :, span], keep, cfg.flush_block, positions)  # U x (B, H, N, D)
        v_tiers = _blockwise_tiers(codec, "v", v[:, :, span], keep, cfg.flush_block, positions)
        for k_u, v_u in zip(k_tiers, v_tiers):
            k_hat, v_hat = k.clone(), v.clone()
            k_hat[:, :, span] = k_u.to(acc_dtype)
            v_hat[:, :, span] = v_u.to(acc_dtype)
            k_hats.append(k_hat)
            v_hats.append(v_hat)
        slot = torch.zeros(b, h, t, dtype=torch.bool, device=query.device)
        slot[:, :, span] = True if keep is None else keep
    out = torch.empty(b, h, rep, t, d, dtype=acc_dtype, device=query.device)  # (B, H, rep, T, D)
    chunk = max(1, SCORE_BUDGET // max(1, b * hq * t))
    # the prompt's queries see nothing quantized (quantized_mask): plain attention, through SDPA
    # (at 4k tokens with the last eighth scored, 7/8 of the rows; the loop below took 3x a forward)
    first = 0 if softcap else min(state.prompt_len, t)
    if first:
        out[:, :, :, :first] = _full_precision_rows(q, k, v, first, mask, window, scale, chunk)
    for q0 in range(first, t, chunk):
        q1 = min(t, q0 + chunk)
        keys = t if mask is not None else q1  # causal: a chunk sees no later key
        rows = slice(q0, q1)
        qc = q[:, :, :, rows]  # (B, H, rep, C, D)
        if mask is not None:
            vis = mask[:, q0:q1, :keys][:, None, None]  # (B|1, 1, 1, C, K)
        else:
            qpos = torch.arange(q0, q1, device=query.device)[:, None]  # (C, 1)
            kpos = torch.arange(keys, device=query.device)[None, :]  # (1, K)
            vis = kpos <= qpos
            if window is not None:
                vis &= kpos > qpos - window
            vis = vis[None, None, None]  # (1, 1, 1, C, K)
        scores = torch.einsum("bhrtd,bhnd->bhrtn", qc, k[:, :, :keys]) * scale  # (B, H, rep, C, K)
        sel: list[torch.Tensor] = []  # per used tier: (B, H, 1, C, K) seen quantized at that tier
        used_v: list[torch.Tensor] = []
        if nq_total:
            qmask2 = quantized_mask(cfg, t, state.prompt_len, query.device, rows, keys)  # (C, K)
            qmask = qmask2[None, None, None] & slot[:, :, None, None, :keys]  # (B, H, 1, C, K)
            tier = None
            used = range(len(codec.tiers))
            if len(codec.tiers) > 1:
                tier = stored_tier_index(cfg, codec, t, query.device, rows, keys)  # (C, K)
                used = set(tier[qmask2].unique().tolist())  # tiers some query of the chunk reaches
            for u in range(len(codec.tiers)):
                if u not in used:
                    continue
                m = qmask if tier is None else qmask & (tier == u)  # (B, H, 1, C, K)
                scores = torch.where(m, torch.einsum("bhrtd,bhnd->bhrtn", qc, k_hats[u][:, :, :keys]) * scale,
                                     scores)
                sel.append(m)
                used_v.append(v_hats[u][:, :, :keys])
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~vis, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
        del scores
        p_fp = probs
        acc = torch.einsum("bhrtn,bhnd->bhrtd", probs, v[:, :, :keys]) if not sel else 0.0
        if sel:
            for m, v_hat in zip(sel, used_v):
                p_u = probs * m
                p_fp = p_fp - p_u  # exact: each probability is either kept whole or removed whole
                acc = acc + torch.einsum("bhrtn,bhnd->bhrtd", p_u, v_hat)
            acc = torch.einsum("bhrtn,bhnd->bhrtd", p_fp, v[:, :, :keys]) + acc
        out[:, :, :, rows] = acc
    out = out.reshape(b, hq, t, d).transpose(1, 2)  # (B, T, Hq, D)
    return out.to(query.dtype), None


def _full_precision_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, mask: torch.Tensor | None,
                         window: int | None, scale: float, chunk: int) -> torch.Tensor:
    """Attention of queries ``0..rows-1`` over the unquantized keys, as :func:`_simulated_attention`
    computes it for rows that see nothing quantized (causal, the sliding ``window``, ``mask``
    (B|1, T, T) bool when given; a row that sees nothing gives 0), through SDPA. ``q`` (B, H, rep,
    T, D), ``k``/``v`` (B, H, T, D); returns (B, H, rep, rows, D)."""
    import torch.nn.functional as F

    b, h, rep, _, d = q.shape
    qr = q[:, :, :, :rows].reshape(b, h * rep, rows, d)  # (B, Hq, R, D): query head h * rep + r
    kr = k[:, :, :rows].repeat_interleave(rep, 1)  # (B, Hq, R, D): no row sees a later key
    vr = v[:, :, :rows].repeat_interleave(rep, 1)
    if mask is None and window is None:
        out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale)  # (B, Hq, R, D)
        return out.reshape(b, h, rep, rows, d)
    out = torch.empty_like(qr)  # (B, Hq, R, D)
    for q0 in range(0, rows, chunk):  # the boolean mask of a chunk of rows only: linear memory
        q1 = min(rows, q0 + chunk)
        if mask is not None:
            vis = mask[:, q0:q1, :q1][:, None]  # (B|1, 1, C, K)
        else:
            qpos = torch.arange(q0, q1, device=q.device)[:, None]  # (C, 1)
            kpos = torch.arange(q1, device=q.device)[None, :]  # (1, K)
            vis = ((kpos <= qpos) & (kpos > qpos - window))[None, None]  # (1, 1, C, K)
        got = F.scaled_dot_product_attention(qr[:, :, q0:q1], kr[:, :, :q1], vr[:, :, :q1], attn_mask=vis, scale=scale)
        out[:, :, q0:q1] = got.nan_to_num(0.0)  # a row that sees nothing (padding): NaN from SDPA, 0 here
    return out.reshape(b, h, rep, rows, d)


def _blockwise_tiers(codec: LayerCodec, side: str, x: torch.Tensor, keep: torch.Tensor | None,
                     block: int, positions: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``codec.roundtrip_tiers`` on (B, H, N, D) with N a multiple of ``block``, every block
    quantized on its own exactly as the runtime flushes it; ``keep`` (B, H, N) or None;
    ``positions`` (B|1, N) the tokens' RoPE positions or None. Returns one (B, H, N, D) per
    stored tier."""
    b, h, n, d = x.shape
    if block == 1:  # per-token layouts: every token is its own group already
        return codec.roundtrip_tiers(side, x, keep, positions)
    nb = n // block
    # fold blocks into the batch dim: (B * NB, H, G, D)
    xb = x.reshape(b, h, nb, block, d).permute(0, 2, 1, 3, 4).reshape(b * nb, h, block, d)
    kb = None if keep is None else keep.reshape(b, h, nb, block).permute(0, 2, 1, 3).reshape(b * nb, h, block)
    pb = None if positions is None else positions.expand(b, n).reshape(b * nb, block)  # (B * NB, G)
    return [y.reshape(b, nb, h, block, d).permute(0, 2, 1, 3, 4).reshape(b, h, n, d)
            for y in codec.roundtrip_tiers(side, xb, kb, pb)]


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
                     codecs: list[LayerCodec] | None = None, prompt_len: int = 1,
                     logits_to_keep: int = 0) -> torch.Tensor:
    """Logits (B, T, V) (float32, or float64 for a float64 model) of a decode-faithful
    teacher-forced forward over ``input_ids`` (B, T); with ``logits_to_keep`` = N > 0 only the last
    N positions' (B, N, V) (a long window's full logits would not fit in memory)."""
    with simulating(model, configs, codecs, prompt_len):
        out = model(input_ids=input_ids, use_cache=False, **({"logits_to_keep": logits_to_keep} if logits_to_keep else {}))
    return out.logits.to(torch.float64 if out.logits.dtype == torch.float64 else torch.float32)
