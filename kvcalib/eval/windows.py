"""Evaluation windows cut from a held-out token stream, and the bootstrap interval over them.

The stream is built exactly as :func:`kvcalib.data.pack_samples` builds it (documents shuffled
with ``seed``, tokenized without special tokens, EOS between documents; a window starts with BOS
where the tokenizer adds one), so ``n`` windows that fit side by side are the very windows
``pack_samples`` returns (the numbers of earlier runs reproduce).

When the text holds fewer than ``n`` disjoint windows, :func:`eval_windows` spaces ``n`` windows
evenly from the stream's start to its end, so neighbours share tokens, but only as far as the
caller allows (``max_overlap``, the fraction of a window shared with its neighbour; 0 by default:
a text too short for the windows asked is refused with the fix). Overlapping windows are not
independent samples: an interval computed over them is narrower than that of as many
independent windows would be. Results record the overlap beside the interval.

:func:`bootstrap_delta_ci`: the paired percentile bootstrap over windows of the perplexity
change against full precision, ``100 * (exp(mean NLL) / exp(mean NLL fp) - 1)``, resampling whole
windows (every window scores the same number of tokens, so the mean of window means is the token
mean).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvcalib.data import token_stream  # noqa: F401  (the evaluation cuts its windows from it; re-exported)
from kvcalib.errors import KvcalibError

log = logging.getLogger(__name__)

BOOTSTRAP_ITERS = 2000
CI_LEVEL = 0.95


@dataclass(frozen=True)
class Windows:
    """``ids`` (n, seq_len) and how they were cut: ``starts`` in the stream, ``overlap`` the
    fraction of a window shared with its neighbour (0: disjoint), ``stream_tokens``."""

    ids: torch.Tensor  # (n, seq_len) LongTensor
    starts: list[int]
    overlap: float
    stream_tokens: int


def leading_bos(tokenizer: Any) -> int | None:
    """The BOS id if the tokenizer adds it when encoding text, else None (pack_samples' rule)."""
    from kvcalib.data import _leading_bos

    return _leading_bos(tokenizer)


def eval_windows(texts: Sequence[str], tokenizer: Any, seq_len: int, n: int, seed: int = 0,
                 max_overlap: float = 0.0, what: str = "the text", opts: dict[str, str] | None = None,
                 allow_fewer: bool = False) -> Windows:
    """``n`` windows of exactly ``seq_len`` tokens (see module docstring); :class:`KvcalibError`
    naming the fix when the text cannot hold them within ``max_overlap``. ``opts``: the option
    that sets each of ``n``, ``seq_len``, ``text``, ``overlap``, shown in the fix (" (--ppl-samples)").
    ``allow_fewer``: a short text gives the disjoint windows it holds (at least one), with a warning,
    as :func:`kvcalib.data.pack_samples` does (the search's held-out proof)."""
    opts = opts or {}
    if seq_len < 2 or n < 1:
        raise ValueError(f"need seq_len >= 2 and n >= 1, got {seq_len} and {n}")
    if not 0.0 <= max_overlap < 1.0:
        raise KvcalibError(f"the window overlap must lie in [0, 1), got {max_overlap}")
    bos = leading_bos(tokenizer)
    body = seq_len - (1 if bos is not None else 0)  # stream tokens per window
    stream = token_stream(texts, tokenizer, seed)
    total = len(stream)
    disjoint = total // body
    if disjoint >= n or (allow_fewer and disjoint >= 1):  # allow_fewer: as many disjoint windows as fit
        if disjoint < n:
            log.warning("only %d of %d windows of %d tokens fit in %s (%d tokens)", disjoint, n, seq_len, what, total)
        starts = [i * body for i in range(min(n, disjoint))]
        overlap = 0.0
    else:
        stride = (total - body) / (n - 1) if n > 1 else 0.0
        overlap = 1.0 - stride / body if n > 1 else 0.0
        if total < body or overlap > max_overlap + 1e-9:
            share = (f", or let neighbouring windows share up to {overlap:.2f} of their tokens{opts.get('overlap', '')}"
                     if total >= body else "")
            raise KvcalibError(
                f"{what} holds {total:,} tokens, room for {disjoint} disjoint window(s) of {seq_len} tokens, not {n}. "
                f"Fix: ask for at most {disjoint} windows{opts.get('n', '')} or shorter ones{opts.get('seq_len', '')}, "
                f"use a longer text{opts.get('text', '')}{share}.")
        starts = [round(i * stride) for i in range(n)]
    rows = [([bos] if bos is not None else []) + stream[s:s + body] for s in starts]
    return Windows(torch.tensor(rows, dtype=torch.long), starts, overlap, total)


def bootstrap_delta_ci(nll: torch.Tensor, nll_fp: torch.Tensor, iters: int = BOOTSTRAP_ITERS,
                       level: float = CI_LEVEL, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``100 * (exp(mean nll) / exp(mean nll_fp) - 1)``, paired,
    resampling whole windows: ``nll`` and ``nll_fp`` are (N, S) per-token NLL of the same tokens."""
    if nll.shape != nll_fp.shape or nll.dim() != 2:
        raise ValueError(f"need two (N, S) tensors of one shape, got {tuple(nll.shape)} and {tuple(nll_fp.shape)}")
    diff = (nll.double().mean(1) - nll_fp.double().mean(1))  # (N,) log ppl ratio per window
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, diff.shape[0], (iters, diff.shape[0]), generator=gen)  # (iters, N)
    deltas = 100.0 * (torch.exp(diff[idx].mean(1)) - 1.0)  # (iters,)
    lo, hi = torch.quantile(deltas, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(lo), float(hi)


__all__ = ["BOOTSTRAP_ITERS", "CI_LEVEL", "Windows", "bootstrap_delta_ci", "eval_windows", "leading_bos",
           "token_stream"]
