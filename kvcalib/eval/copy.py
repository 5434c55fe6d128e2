"""Copy: can the model still quote its own context through the compressed cache?

Perplexity hides the failure users notice first: a cache that keeps the gist but loses the exact
tokens. A passage of ``passage_len`` tokens of held-out text is repeated::

    [BOS] P P            (length L = 2 * passage_len, plus BOS where the tokenizer adds one)

and the model is scored on the last ``tail`` tokens of the second copy, which it can predict by
copying from the first: the mean negative log-likelihood (nats/token) of those tokens. The first
``L - tail`` tokens are the prompt (prefilled: its own attention runs in full precision, then it
is compressed, as with ``--score-last`` in the search); the ``tail`` scored tokens are decode
steps reading the compressed cache, so the first copy is read as the cache stores it.

- ``nll``: through the decode-faithful simulation (:func:`kvcalib.eval.perplexity.position_nll`
  with ``prompt_len = L - tail``), one forward per passage;
- ``nll_decode`` (``decode=True``): through a real token-by-token decode with
  :class:`~kvcalib.runtime.cache.CompressedCache`: the prompt in one forward, then ``tail``
  teacher-forced steps of one token each (what ``model.generate`` does, with the true token fed);
- ``nll_fp``: full precision (the plain forward) on the same tokens;
- ``nll_reference``: full precision on the same tokens of the *first* copy, where there is
  nothing to copy: the model's ordinary loss on this text. A cache that copies nothing reads
  about this.

Passages are cut side by side from the held-out stream (:func:`kvcalib.eval.windows.eval_windows`,
seeded), never overlapping.

The search scores the same thing on calibration text (:func:`copy_windows`, issue 53): a scoring
window of ``T`` tokens whose last ``span`` tokens are replaced by a copy of its own first ``span``
(after the BOS), ``[BOS] A ... A``, so that its scored decode steps (the last ``tail``) can be
predicted only by reading the start of the window back through the compressed cache. Both layouts
are :class:`CopyInputs` made by :func:`repeat_span`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

COPY_LEN = 3000
COPY_TAIL = 256


@dataclass(frozen=True)
class CopyInputs:
    """``ids`` (N, L): each row [BOS] P ... P, its last ``passage_len`` tokens an exact copy of
    ``[offset, offset + passage_len)`` (for the eval metric nothing lies between the copies);
    ``tail`` scored tokens at the end of the second copy; ``offset`` 1 with a BOS, else 0 (the
    first copy starts there)."""

    ids: torch.Tensor  # (N, L)
    passage_len: int
    tail: int
    offset: int

    @property
    def prompt_len(self) -> int:
        return self.ids.shape[1] - self.tail


def repeat_span(prefix: torch.Tensor, start: int, span_len: int) -> torch.Tensor:
    """``prefix`` (N, P) followed by an exact copy of its own tokens ``[start, start + span_len)``:
    (N, P + span_len)."""
    if not (0 <= start and span_len >= 1 and start + span_len <= prefix.shape[1]):
        raise ValueError(f"the span [{start}, {start + span_len}) lies outside the {prefix.shape[1]}-token prefix")
    return torch.cat([prefix, prefix[:, start:start + span_len]], dim=1)  # (N, P + span_len)


def copy_windows(windows: torch.Tensor, tail: int, offset: int = 0) -> CopyInputs:
    """The search objective's copy windows (module docstring): ``windows`` (N, T) with their last
    ``span = min(2 * tail, (T - offset) // 2)`` tokens replaced by a copy of ``[offset, offset + span)``;
    the scored ``tail`` is the copy's end. ``offset``: 1 where each window starts with a BOS (it is
    not copied). Raises ValueError when ``tail > (T - offset) // 2``: the copy would overlap its source.

    Why a span longer than the tail: a model starts copying only once it has seen a few tokens of
    the repeat (the induction match); the first ``span - tail`` copied tokens sit in the prompt, so
    every scored step is mid-copy, as the eval metric scores the end of a long second copy. Why the
    source at the window's start: it is as far back as the window reaches, beyond any full-precision
    window of the recent tokens, so the scored steps read it quantized.
    """
    n_tokens = windows.shape[1]
    room = (n_tokens - offset) // 2  # the source and the copy may not overlap
    if not 1 <= tail <= room:
        raise ValueError(f"a copy window of {n_tokens} tokens holds a scored copy of at most {room} tokens, got {tail}")
    span = min(2 * tail, room)
    ids = repeat_span(windows[:, :n_tokens - span], offset, span)  # (N, T): [BOS] A ... A
    return CopyInputs(ids, span, tail, offset)


def build_copy_inputs(texts: Sequence[str], tokenizer: Any, passage_len: int = COPY_LEN, tail: int = COPY_TAIL,
                      n: int = 4, seed: int = 0, what: str = "the text",
                      opts: dict[str, str] | None = None, allow_fewer: bool = False) -> CopyInputs:
    """``n`` repeated passages (module docstring); :class:`KvcalibError` when the text is too short
    (``allow_fewer``: the passages it holds, at least one, with a warning)."""
    from kvcalib.eval.windows import eval_windows, leading_bos

    if not 1 <= tail <= passage_len:
        raise ValueError(f"the copy tail must lie in [1, passage_len={passage_len}], got {tail}")
    offset = 1 if leading_bos(tokenizer) is not None else 0
    passages = eval_windows(texts, tokenizer, passage_len + offset, n, seed, 0.0, what, opts,
                            allow_fewer=allow_fewer).ids  # (N, [BOS] + P)
    return CopyInputs(repeat_span(passages, offset, passage_len), passage_len, tail, offset)  # ids (N, [BOS] + 2P)


@torch.no_grad()
def copy_fp(model, inputs: CopyInputs, batch_size: int = 1,
            on_batch: Callable[[int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Full precision: (NLL of the second copy's tail, NLL of the same tokens of the first copy),
    each (N, tail) float64."""
    from kvcalib.eval.perplexity import position_nll_windows

    per = position_nll_windows(model, inputs.ids, None, None, 1, batch_size, on_batch)  # (N, L - 1): token t+1
    end_first = inputs.offset + inputs.passage_len  # the first copy's tokens are [offset, end_first)
    first = per[:, end_first - inputs.tail - 1:end_first - 1]  # (N, tail)
    return per[:, -inputs.tail:], first


@torch.no_grad()
def copy_simulated(model, inputs: CopyInputs, configs, codecs, batch_size: int = 1,
                   on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """NLL (N, tail) of the scored tokens through the decode-faithful simulation."""
    from kvcalib.eval.perplexity import position_nll_windows

    per = position_nll_windows(model, inputs.ids, configs, codecs, inputs.prompt_len, batch_size, on_batch)  # (N, tail)
    return per[:, -inputs.tail:]


@torch.no_grad()
def copy_decoded(model, inputs: CopyInputs, recipe, batch_size: int = 1,
                 on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """NLL (N, tail) of the scored tokens through a real decode with a fresh
    ``CompressedCache.from_recipe(model, recipe)`` per batch: the prompt in one forward, then one
    teacher-forced token per step."""
    from kvcalib.models import cache_kwarg
    from kvcalib.runtime.cache import CompressedCache

    device = next(model.parameters()).device
    key = cache_kwarg(model)
    rows = []
    for start in range(0, inputs.ids.shape[0], batch_size):
        ids = inputs.ids[start:start + batch_size].to(device)  # (B, L)
        cache = CompressedCache.from_recipe(model, recipe)
        p = inputs.prompt_len
        logits = model(input_ids=ids[:, :p], **{key: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, V)
        nll = torch.empty(ids.shape[0], inputs.tail, dtype=torch.float64)  # (B, tail)
        for step in range(inputs.tail):
            target = ids[:, p + step]  # (B,)
            nll[:, step] = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none").double().cpu()
            if step + 1 < inputs.tail:
                logits = model(input_ids=target[:, None], **{key: cache}, use_cache=True).logits[:, -1]  # (B, V)
        rows.append(nll)
        if on_batch is not None:
            on_batch(ids.shape[0])
    return torch.cat(rows)


__all__ = ["COPY_LEN", "COPY_TAIL", "CopyInputs", "build_copy_inputs", "copy_decoded", "copy_fp",
           "copy_simulated", "copy_windows", "repeat_span"]
