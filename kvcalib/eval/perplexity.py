"""Decode-faithful perplexity: what token-by-token decoding through the compressed cache scores.

Which positions are scored. For a window ``ids`` (N, L) treated as a ``prompt_len``-token prompt
(P) followed by teacher-forced decode steps, the logits at position ``t`` predict token ``t + 1``.
We score every prediction the decoder makes, i.e. positions ``t`` in ``[max(P, 1) - 1, L - 2]``
predicting tokens ``max(P, 1) .. L - 1``: ``L - max(P, 1)`` tokens per window. With the default
P = 1 that is the usual causal-LM perplexity over the whole window (every token but the first);
with P > 1 the prompt's own tokens are context only, as in a prompted generation.

The logits come from :func:`kvcalib.simulate.simulated_logits`: one teacher-forced forward per
batch whose attention reproduces, per (query, key), what the runtime cache would show
(full precision or the flushed block's quantized value), proven equal to a real decode in
``tests/unit/test_cache.py``. ``configs=None`` scores the plain model forward instead (full
precision); for a recipe that compresses nothing the two agree to float rounding
(``tests/unit/test_eval.py``).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from kvcalib.layout import LayerConfig
from kvcalib.codec import LayerCodec


def scored_slice(seq_len: int, prompt_len: int = 1) -> slice:
    """Logit positions that are scored in a window of ``seq_len`` tokens (see module docstring)."""
    if seq_len < 2:
        raise ValueError(f"a window needs at least 2 tokens to score one, got {seq_len}")
    start = max(prompt_len, 1) - 1
    if start > seq_len - 2:
        raise ValueError(f"prompt_len {prompt_len} leaves nothing to score in a window of {seq_len} tokens")
    return slice(start, seq_len - 1)


LOGIT_CHUNK = 1024  # positions per lm-head chunk: full logits of a 32k window would be 6-20 GB
CHECK_POSITIONS = 4  # last positions whose logits the model also computes its own way (checked)


@torch.no_grad()
def position_nll(model, ids: torch.Tensor, configs: Sequence[LayerConfig] | None = None,
                 codecs: Sequence[LayerCodec] | None = None, prompt_len: int = 1) -> torch.Tensor:
    """Negative log-likelihood of every next token, float64 ``(B, L - 1)``: entry ``t`` is
    ``-log p(ids[:, t + 1] | ids[:, :t + 1])``, decode-faithful through ``configs``/``codecs``
    (:func:`kvcalib.simulate.simulating`) or the plain forward (``configs=None``).

    Memory stays linear in L: the simulation chunks its queries, and the logits are never held
    whole -- the decoder's last hidden states are captured and the output head is applied
    :data:`LOGIT_CHUNK` positions at a time. The model also computes its own logits for the last
    :data:`CHECK_POSITIONS` positions (``logits_to_keep``); a head whose post-processing this
    function does not reproduce (beyond Gemma's final softcapping) is refused instead of scored.
    """
    import contextlib

    from kvcalib.errors import KvcalibError

    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (B, L >= 2), got shape {tuple(ids.shape)}")
    captured: list[torch.Tensor] = []

    def grab(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", output)
        captured.append(hidden)

    hook = model.get_decoder().register_forward_hook(grab)
    try:
        if configs is None:
            scope = contextlib.nullcontext()
        else:
            from kvcalib.simulate import simulating

            scope = simulating(model, list(configs), list(codecs) if codecs is not None else None, prompt_len)
        with scope:
            own = model(input_ids=ids, use_cache=False, logits_to_keep=CHECK_POSITIONS).logits.float()
    finally:
        hook.remove()
    hidden = captured[-1]  # (B, L, hidden)
    head = model.get_output_embeddings()
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    softcap = getattr(cfg, "final_logit_softcapping", None)

    def logits_of(h: torch.Tensor) -> torch.Tensor:
        out = head(h).float()  # (B, C, V)
        return softcap * torch.tanh(out / softcap) if softcap else out

    n = ids.shape[1]
    mine = logits_of(hidden[:, n - CHECK_POSITIONS:])  # (B, 4, V)
    if not torch.allclose(mine, own[:, -CHECK_POSITIONS:], rtol=1e-3, atol=1e-3 * float(own.abs().max()) + 1e-5):
        raise KvcalibError(f"{type(model).__name__} post-processes its logits in a way kvcalib's long-context "
                           "scorer does not reproduce: evaluate it at a context whose full logits fit in memory")
    nll = torch.empty(ids.shape[0], n - 1, dtype=torch.float64)  # (B, L - 1)
    for c0 in range(0, n - 1, LOGIT_CHUNK):
        c1 = min(n - 1, c0 + LOGIT_CHUNK)
        logits = logits_of(hidden[:, c0:c1])  # (B, C, V)
        target = ids[:, c0 + 1:c1 + 1].to(logits.device)  # (B, C)
        nll[:, c0:c1] = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), target, reduction="none").double().cpu()
    return nll


@torch.no_grad()
def decode_faithful_nll(model, ids: torch.Tensor, configs: Sequence[LayerConfig] | None = None,
                        codecs: Sequence[LayerCodec] | None = None, prompt_len: int = 1,
                        batch_size: int = 1,
                        on_batch: Callable[[int], None] | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood (nats, float64) and the number of scored tokens.

    ``ids`` (N, L) LongTensor of token windows. ``configs``/``codecs``: one per layer (pass
    :meth:`kvcalib.recipe.Recipe.codecs` so a fitted recipe's tensors are used);
    ``configs=None`` = plain full-precision forward. Scored positions: :func:`scored_slice`.
    ``on_batch(n_windows_done_in_this_batch)`` is called after each batch (progress).
    """
    per = position_nll_windows(model, ids, configs, codecs, prompt_len, batch_size, on_batch)  # (N, S)
    return float(per.sum()), per.numel()


@torch.no_grad()
def position_nll_windows(model, ids: torch.Tensor, configs: Sequence[LayerConfig] | None = None,
                         codecs: Sequence[LayerCodec] | None = None, prompt_len: int = 1, batch_size: int = 1,
                         on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """NLL of every scored token of every window, float64 ``(N, S)`` (:func:`scored_slice`)."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be (N, L), got shape {tuple(ids.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    span = scored_slice(ids.shape[1], prompt_len)
    rows = []
    for start in range(0, ids.shape[0], batch_size):
        batch = ids[start:start + batch_size].to(device)  # (B, L)
        rows.append(position_nll(model, batch, configs, codecs, prompt_len)[:, span])  # (B, S)
        if on_batch is not None:
            on_batch(batch.shape[0])
    return torch.cat(rows)


def simulation_bytes(config, seq_len: int, batch: int = 1, tiers: int = 1, param_bytes: int = 4) -> int:
    """An upper estimate of the working memory one decode-faithful forward of ``batch`` windows of
    ``seq_len`` tokens takes beyond the weights (bytes): the layer's activations (MLP widest), the
    simulation's float32 K/V copies per stored tier and its query-chunk score matrices
    (:data:`kvcalib.simulate.SCORE_BUDGET`), the captured hidden states and one head chunk.
    ``config`` is the model's (text) config."""
    from kvcalib.simulate import SCORE_BUDGET

    cfg = getattr(config, "get_text_config", lambda: config)()
    hidden = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", 4 * hidden))
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    vocab = int(cfg.vocab_size)
    tokens = batch * seq_len
    activations = tokens * (4 * hidden + 3 * inter) * param_bytes
    kv_copies = (2 + 2 * tiers) * tokens * kv_heads * head_dim * 4 + 2 * tokens * heads * head_dim * 4
    scores = 6 * SCORE_BUDGET * 4
    head = batch * LOGIT_CHUNK * vocab * 4 * 2 + tokens * hidden * 4
    return int(activations + kv_copies + scores + head)


def free_memory_bytes(device) -> int | None:
    """Memory available for work on ``device`` (bytes), or None when unknown."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        return None
    return int(psutil.virtual_memory().available)


def position_buckets(per_position: torch.Tensor, first_position: int, edges: Sequence[int]) -> list[dict]:
    """Mean NLL per bucket of token positions: ``per_position`` (N, S) scores positions
    ``first_position + 1 .. first_position + S`` (the predicted tokens); buckets ``[edges[i],
    edges[i + 1])``. Returns ``[{"start", "end", "tokens", "nll", "ppl"}]`` for non-empty buckets."""
    pos = torch.arange(per_position.shape[1]) + first_position + 1  # (S,) predicted token positions
    out = []
    for lo, hi in zip(edges, edges[1:]):
        sel = (pos >= lo) & (pos < hi)
        if bool(sel.any()):
            vals = per_position[:, sel]
            mean = float(vals.mean())
            out.append({"start": int(lo), "end": int(hi), "tokens": int(vals.numel()), "nll": mean,
                        "ppl": math.exp(mean)})
    return out


def perplexity(model, ids: torch.Tensor, configs: Sequence[LayerConfig] | None = None,
               codecs: Sequence[LayerCodec] | None = None, prompt_len: int = 1, batch_size: int = 1,
               on_batch: Callable[[int], None] | None = None) -> float:
    """exp(token-weighted mean NLL) over ``ids`` (N, L); see :func:`decode_faithful_nll`."""
    total, count = decode_faithful_nll(model, ids, configs, codecs, prompt_len, batch_size, on_batch)
    return math.exp(total / count)


__all__ = ["decode_faithful_nll", "free_memory_bytes", "perplexity", "position_buckets", "position_nll",
           "position_nll_windows", "scored_slice", "simulation_bytes"]
