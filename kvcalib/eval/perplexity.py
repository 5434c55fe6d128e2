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


@torch.no_grad()
def _window_logits(model, ids: torch.Tensor, configs: Sequence[LayerConfig] | None,
                   codecs: Sequence[LayerCodec] | None, prompt_len: int) -> torch.Tensor:
    """Logits (B, L, V) float32 for ``ids`` (B, L): decode-faithful, or the plain forward."""
    if configs is None:
        return model(input_ids=ids, use_cache=False).logits.float()
    from kvcalib.simulate import simulated_logits

    return simulated_logits(model, ids, list(configs), list(codecs) if codecs is not None else None,
                            prompt_len=prompt_len)


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
    if ids.dim() != 2:
        raise ValueError(f"ids must be (N, L), got shape {tuple(ids.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    span = scored_slice(ids.shape[1], prompt_len)
    total = 0.0
    count = 0
    for start in range(0, ids.shape[0], batch_size):
        batch = ids[start:start + batch_size].to(device)  # (B, L)
        logits = _window_logits(model, batch, configs, codecs, prompt_len)  # (B, L, V)
        pred = logits[:, span]  # (B, S, V): S scored positions
        target = batch[:, span.start + 1:span.stop + 1]  # (B, S): the tokens they predict
        nll = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1),
                                                reduction="sum")
        total += float(nll.double())
        count += target.numel()
        del logits, pred
        if on_batch is not None:
            on_batch(batch.shape[0])
    return total, count


def perplexity(model, ids: torch.Tensor, configs: Sequence[LayerConfig] | None = None,
               codecs: Sequence[LayerCodec] | None = None, prompt_len: int = 1, batch_size: int = 1,
               on_batch: Callable[[int], None] | None = None) -> float:
    """exp(token-weighted mean NLL) over ``ids`` (N, L); see :func:`decode_faithful_nll`."""
    total, count = decode_faithful_nll(model, ids, configs, codecs, prompt_len, batch_size, on_batch)
    return math.exp(total / count)


__all__ = ["decode_faithful_nll", "perplexity", "scored_slice"]
