"""The PyTorch reference attention over a :class:`~kvcalib.runtime.cache.CompressedLayer`: the
specification every kernel path is tested against.

It reads the compressed layer segment by segment (sinks, a few packed blocks at a time, the OTT
outlier pools, the full-precision window) with an online softmax, so no dequantized copy of the
whole cache ever exists. Packed slots of tokens that live in the outlier pool are masked out (the
segment's ``keep``) and the pools are attended in full precision at their own positions, so every
token is seen exactly once. Queries run in chunks (:data:`SCORE_BUDGET`): a 32k-token prompt's own
attention never builds a (T, T) score matrix per head.
"""

from __future__ import annotations

import torch

# score elements per query chunk (batch x query heads x chunk x segment keys): 2**26 float32 =
# 256 MiB, so a 32k-token prefill runs in chunks of ~140 queries instead of a 57 GB matrix
SCORE_BUDGET = 1 << 26


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention arithmetic: float32, or float64 for a float64 model (exactness tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible_mask(attention_mask: torch.Tensor | None, layer, q_len: int, device) -> torch.Tensor:
    """(B|1, Tq, KV) bool, True where query t may attend key position j."""
    kv = layer.n_seen
    if attention_mask is not None:
        m = attention_mask
        if m.dim() == 4:
            m = m[:, 0]  # (B, Tq, KV)
        if m.dtype != torch.bool:
            m = m > torch.finfo(m.dtype).min / 2  # additive float mask: 0 visible, -inf/min hidden
        return m[..., -kv:].to(device)
    q_pos = torch.arange(kv - q_len, kv, device=device)[:, None]  # (Tq, 1)
    k_pos = torch.arange(kv, device=device)[None, :]  # (1, KV)
    vis = k_pos <= q_pos
    if layer.sliding_window is not None:
        vis &= k_pos > q_pos - layer.sliding_window
    return vis[None]  # (1, Tq, KV)


def _segment_visible(visible: torch.Tensor, seg) -> torch.Tensor:
    """Which (query, key) pairs of one segment count: (B|1, H|1, 1, Tq, N) bool.

    ``visible`` (B|1, Tq, KV) over absolute positions; contiguous segments slice it, the pools
    gather it at their positions (empty slots, -1, never count); ``keep`` masks packed slots.
    """
    n = seg.k.shape[-2]
    if seg.positions is None:
        vis = visible[:, None, None, :, seg.start:seg.start + n]  # (B|1, 1, 1, Tq, N)
    else:
        pos = seg.positions  # (B, H, N)
        b, h, _ = pos.shape
        tq = visible.shape[1]
        rows = visible.expand(b, -1, -1)[:, None].expand(b, h, tq, visible.shape[-1])  # (B, H, Tq, KV)
        idx = pos.long().clamp_min(0)[:, :, None, :].expand(b, h, tq, n)  # (B, H, Tq, N)
        vis = (rows.gather(-1, idx) & (pos >= 0)[:, :, None, :])[:, :, None]  # (B, H, 1, Tq, N)
    if seg.keep is not None:
        vis = vis & seg.keep[:, :, None, None, :]  # (B, H, 1, Tq, N)
    return vis


def attend_compressed(query: torch.Tensor, layer, visible: torch.Tensor, scaling: float,
                      softcap: float | None = None, block_tokens: int = 256) -> torch.Tensor:
    """Reference attention of ``query`` (B, Hq, Tq, D) over everything ``layer`` holds.

    ``visible`` (B|1, Tq, KV) bool. Returns (B, Tq, Hq, D) in :func:`compute_dtype`. Online
    softmax over the segments: m (running max), l (running sum), acc (running weighted sum).
    ``layer`` is one unpadded layer: a padded batch's rows come one by one, through
    :func:`kvcalib.runtime.backend.decode_attention` (a ragged layer raises).
    """
    b, hq, tq, d = query.shape
    widest = max(layer.n_seen, 1)  # no segment holds more keys than the layer has seen
    chunk = max(1, SCORE_BUDGET // (b * hq * min(widest, max(block_tokens, layer.pend_k.shape[-2] if
                                                              layer.pend_k is not None else 0) or 1)))
    if tq > chunk:  # long prefill: query chunks (the segments are read again per chunk, exactly)
        outs = [attend_compressed(query[:, :, q0:q0 + chunk], layer, visible[:, q0:q0 + chunk], scaling, softcap,
                                  block_tokens) for q0 in range(0, tq, chunk)]
        return torch.cat(outs, dim=1)  # (B, Tq, Hq, D)
    h = layer.sink_k.shape[1]
    rep = hq // h
    acc_dtype = compute_dtype(query.dtype)
    q = query.to(acc_dtype).reshape(b, h, rep, tq, d)  # (B, H, rep, Tq, D)
    m = torch.full((b, h, rep, tq), float("-inf"), device=query.device, dtype=acc_dtype)  # running max
    l = torch.zeros((b, h, rep, tq), device=query.device, dtype=acc_dtype)  # running denominator
    acc = torch.zeros((b, h, rep, tq, d), device=query.device, dtype=acc_dtype)  # running numerator
    for seg in layer.segments(block_tokens, acc_dtype):  # seg.k, seg.v: (B, H, N, D)
        k, v = seg.k, seg.v
        s = torch.einsum("bhrtd,bhnd->bhrtn", q, k) * scaling  # (B, H, rep, Tq, N)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        vis = _segment_visible(visible, seg)  # (B|1, H|1, 1, Tq, N)
        s = s.masked_fill(~vis, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])  # masked -> exp(-inf) = 0
        corr = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m - m_safe))
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.einsum("bhrtn,bhnd->bhrtd", p, v)
        m = m_new
    out = acc / l.clamp_min(1e-30)[..., None]  # rows with nothing visible stay 0
    return out.reshape(b, hq, tq, d).transpose(1, 2)  # (B, Tq, Hq, D)


# the most bytes of attention scores one SDPA call of :func:`full_precision_prefill` may need if it
# falls back to the math kernel (query rows are chunked to stay under it)
PREFILL_SCORE_BYTES = 1 << 30
# a causal prompt on the CPU attends in one call whatever its length (its flash kernel holds no (T, T)
# scores); the tests turn it off to run the chunks CUDA's float32 calls take
CPU_CAUSAL_WHOLE = True


def full_precision_prefill(query: torch.Tensor, layer, visible: torch.Tensor | None,
                           scaling: float) -> torch.Tensor | None:
    """A prompt's own attention while ``layer`` holds nothing compressed yet -- sinks and pending
    tokens only, positions ``[0, n_seen)`` -- through ``torch.nn.functional.scaled_dot_product_attention``
    (flash / memory-efficient kernels: no (T, T) score matrix) in :func:`compute_dtype`; (B, Tq, Hq, D),
    or None when the layer holds anything else (packed blocks, pools, dropped sinks). One unpadded
    layer (a padded batch's rows: :func:`kvcalib.runtime.backend.decode_attention`).

    The same function as :func:`attend_compressed` over full-precision K/V (exact attention either
    way; the online softmax and SDPA differ in rounding only: tests/unit/test_long_context.py).
    ``visible`` (B|1, Tq, KV) bool, or None: causal over the prompt (no padding).

    A float16/bfloat16 query attends in its own dtype, as the model's own SDPA attention does over
    the same uncompressed prompt (float32 there cost a 16k prompt's attention ~10x: no flash kernel
    in float32, and the query chunks below turn a causal call into masked ones); other dtypes in
    :func:`compute_dtype`. A causal prompt is one call, unchunked, in half precision and on the
    CPU. A ``visible`` that is exactly causal (a padded batch's row whose whole prompt is this
    chunk: its slice of the batch's mask) takes the causal call the row would take alone, so the
    row computes what its prompt alone computes, bit for bit."""
    if layer.packed.n or layer.outliers.state is not None or layer.sinks_dropped:
        return None
    s, u = layer.sink_k.shape[-2], layer.pend_k.shape[-2]
    if layer.pend_start != s or s + u != layer.n_seen:
        return None
    half = query.dtype in (torch.float16, torch.bfloat16)
    dtype = query.dtype if half else compute_dtype(query.dtype)
    k = layer.pend_k if not s else torch.cat([layer.sink_k, layer.pend_k], dim=-2)  # (B, H, KV, D)
    v = layer.pend_v if not s else torch.cat([layer.sink_v, layer.pend_v], dim=-2)
    tq, kv = query.shape[-2], k.shape[-2]
    hq = query.shape[1]
    causal = not layer.is_sliding and tq == kv and (visible is None or _is_causal(visible))
    if visible is None and not causal:
        visible = visible_mask(None, layer, tq, query.device)  # (1, Tq, KV)
    # Why the heads are repeated and the queries chunked: SDPA's memory-efficient kernels take neither
    # grouped-query heads (enable_gqa) in float32 nor every mask, and its fallback (the math kernel)
    # builds the whole (B, Hq, Tq, KV) score matrix: 56 GiB for Qwen2.5-0.5B's 14 heads at 32k tokens,
    # more than an 80 GB GPU had left. Repeated K/V heads cost Hq/H x the prompt's K/V once; chunks of
    # query rows bound the fallback to PREFILL_SCORE_BYTES (rows are independent: the same result).
    k = k.to(dtype).repeat_interleave(hq // k.shape[1], dim=1)  # (B, Hq, KV, D)
    v = v.to(dtype).repeat_interleave(hq // v.shape[1], dim=1)  # (B, Hq, KV, D)
    q = query.to(dtype)  # (B, Hq, Tq, D)
    rows = max(1, PREFILL_SCORE_BYTES // (q.shape[0] * hq * kv * q.element_size()))
    # a causal call takes a flash kernel that holds no (T, T) scores wherever one exists for it: in
    # half precision, and on the CPU in any dtype (where the chunks' masks cost 2.5x the time: one
    # SmolLM2 layer at 8k, 1.34 s against 0.54 s); float32 on CUDA keeps the chunks
    if rows >= tq or (causal and (half or (query.device.type == "cpu" and CPU_CAUSAL_WHOLE))):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=None if causal else visible[:, None], is_causal=causal, scale=scaling)  # (B, Hq, Tq, D)
    else:
        keys = torch.arange(kv, device=query.device)  # (KV,)
        chunks = []
        for q0 in range(0, tq, rows):
            q1 = min(tq, q0 + rows)
            if causal:  # query t at position t (tq == kv) sees keys 0..t
                mask = (torch.arange(q0, q1, device=query.device)[:, None] >= keys)[None, None]  # (1, 1, c, KV)
            else:
                mask = visible[:, None, q0:q1]  # (B|1, 1, c, KV)
            chunks.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, q0:q1], k, v, attn_mask=mask, scale=scaling))  # (B, Hq, c, D)
        out = torch.cat(chunks, dim=2)  # (B, Hq, Tq, D)
    # a query row with nothing visible (padding) gives NaN from SDPA and 0 from the reference
    return out.nan_to_num(0.0).transpose(1, 2)  # (B, Tq, Hq, D)


# query rows of a mask :func:`_is_causal` reads at once: its temporaries stay ~64 MB at any length
# (a whole (T, T) copy would be 17 GB at 128k tokens)
CAUSAL_CHECK_ELEMENTS = 1 << 26


def _is_causal(visible: torch.Tensor) -> bool:
    """Whether ``visible`` (1, T, T) bool is exactly lower-triangular (query t sees keys 0..t):
    a few reductions over chunks of query rows and one host copy, once per row of a padded prompt.
    The layers of one forward slice their rows from the same mask tensor (the model's, which
    nothing writes during the forward), so the answer is kept on it, per slice, like
    :func:`kvcalib.runtime.attention._host_rows`: the next layer's row reads it, not the mask."""
    if visible.shape[0] != 1 or visible.shape[-1] != visible.shape[-2]:
        return False
    root = visible if visible._base is None else visible._base
    key = (visible.storage_offset(), tuple(visible.shape), visible.stride())
    memo = getattr(root, "_kvcalib_causal", None)
    if memo is None:
        memo = root._kvcalib_causal = {}
    if key not in memo:
        memo[key] = _lower_triangular(visible)
    return memo[key]


def _lower_triangular(visible: torch.Tensor) -> bool:
    """:func:`_is_causal`'s reading of the mask."""
    t = visible.shape[-1]
    step = max(1, CAUSAL_CHECK_ELEMENTS // t)
    upper = visible.new_zeros((), dtype=torch.long)  # () keys after their query seen
    for r0 in range(0, t, step):
        upper += visible[0, r0:r0 + step].triu(1 + r0).sum()  # (rows, T) chunk, its own diagonal offset
    seen = visible[0].sum()  # () int64: T (T + 1) / 2 when exactly the lower triangle is
    upper, seen = torch.stack([upper, seen]).tolist()
    return not upper and seen == t * (t + 1) // 2
