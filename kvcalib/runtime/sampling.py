"""Choosing the next token by sampling, on the device and without a host sync.

:class:`Sampling` is the user's choice (temperature, top-k, top-p, seed); ``None`` in its place
means greedy decoding. :func:`sample` turns logits ``(B, V)`` into tokens ``(B, 1)`` with fixed
shapes and no data-dependent control flow, so :class:`~kvcalib.runtime.graphs.GraphDecoder` can
capture it inside a CUDA graph:

1. temperature: the logits are divided by it;
2. top-k: ``torch.topk`` keeps the k largest as *candidates* ``(B, k)`` (sorted, largest first);
   with top-p alone the candidates are the whole vocabulary sorted (``torch.sort``), otherwise
   the vocabulary as it is;
3. top-p: among the sorted candidates, the smallest prefix whose probability (renormalised over
   the candidates, as transformers does after top-k) reaches p; the first always stays;
4. the draw: Gumbel-max, ``argmax(score + G)`` with ``G = -log(-log(U))``, ``U`` uniform from
   ``torch.rand`` on the given generator. It picks token i with probability ``softmax(score)_i``
   and needs no ``torch.multinomial``, which can synchronise with the host (gpt-fast avoids it
   for the same reason).

Filtered candidates carry ``-inf`` and can never win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcalib.errors import KvcalibError


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_filters(top_k, top_p) -> None:
    """Refuse a top-k or top-p setting that means nothing (shared by :class:`Sampling` and the CLI)."""
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise KvcalibError(f"top_k (--top-k) must be an integer >= 0 (got {top_k!r}): 0 turns top-k off, "
                           "k > 0 samples among the k most likely tokens.")
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise KvcalibError(f"top_p (--top-p) must be in (0, 1] (got {top_p!r}): 1 turns top-p off, e.g. 0.9 "
                           "samples among the most likely tokens that hold 90% of the probability.")


@dataclass(frozen=True)
class Sampling:
    """How to sample the next token; decoders take ``sampling=None`` for greedy decoding.

    ``temperature`` > 0 divides the logits; ``top_k`` (0 = off) keeps the k most likely tokens;
    ``top_p`` (1 = off) then keeps the most likely tokens that hold at least that probability;
    ``seed`` (None = fresh randomness) seeds the decoder's own generator.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t <= 0:
            raise KvcalibError(f"temperature (--temperature) must be a finite number > 0 to sample (got {t!r}): "
                               "use e.g. 0.7 or 1.0, or decode greedily (sampling=None, --temperature 0).")
        check_filters(self.top_k, self.top_p)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or self.seed < 0):
            raise KvcalibError(f"seed (--seed) must be an integer >= 0 or None (got {self.seed!r}).")


def sampling_from_flags(temperature: float, top_k: int = 0, top_p: float = 1.0,
                        seed: int | None = None) -> Sampling | None:
    """The ``kvcalib run`` flags as a :class:`Sampling`, or ``None`` for greedy (``--temperature 0``).

    Every value is checked even when greedy; ``--top-k``/``--top-p`` with greedy decoding would do
    nothing, so they are refused rather than ignored (``--seed`` alone is harmless and ignored).
    """
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise KvcalibError(f"--temperature must be a finite number >= 0 (got {temperature!r}): 0 decodes "
                           "greedily, e.g. 0.7 or 1.0 samples.")
    check_filters(top_k, top_p)
    if temperature == 0:
        if top_k != 0 or top_p != 1.0:
            raise KvcalibError("--top-k/--top-p shape sampling, and --temperature 0 (the default) decodes "
                               "greedily: add e.g. --temperature 1.0 to sample, or leave them out.")
        return None
    return Sampling(temperature=float(temperature), top_k=top_k, top_p=float(top_p), seed=seed)


def candidates(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, top-k and top-p applied to ``logits`` (B, V).

    Returns ``scores`` (B, C) float32, the scaled logits of the candidates with ``-inf`` where
    filtered out, and ``ids`` (B, C) int64, their token ids; ``ids`` is None when the candidates
    are the vocabulary in order (C = V, temperature only). ``logits`` is not modified.
    """
    scores = logits.float() / sampling.temperature  # (B, V) float32
    ids = None
    if 0 < sampling.top_k < scores.shape[-1]:
        scores, ids = torch.topk(scores, sampling.top_k, dim=-1)  # (B, k) float32 largest first, (B, k) int64
    elif sampling.top_p < 1.0:
        scores, ids = torch.sort(scores, dim=-1, descending=True)  # (B, V) float32, (B, V) int64
    if sampling.top_p < 1.0:
        probs = torch.softmax(scores, dim=-1)  # (B, C) float32, over the candidates
        mass_before = probs.cumsum(-1) - probs  # (B, C) float32: probability of the more likely candidates
        # keep a candidate while the ones before it hold less than p: the smallest prefix reaching
        # p; the first has nothing before it (exactly 0) and p > 0, so it always stays
        scores = scores.masked_fill(mass_before >= sampling.top_p, float("-inf"))  # (B, C)
    return scores, ids


def draw(scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Index (B, 1) int64 into ``scores`` (B, C), drawn with probability ``softmax(scores)``.

    Gumbel-max with ``U`` from ``generator`` (None: the device's default generator). ``U = 0``
    (probability 2**-24 per element) gives ``G = -inf``: that element loses this draw, and a row
    where every element does still returns index 0 (the first, largest, candidate); no NaN arises
    since ``G`` < 17 is finite or ``-inf``.
    """
    uniform = torch.rand(scores.shape, generator=generator, device=scores.device,
                         dtype=torch.float32)  # (B, C) float32 in [0, 1)
    gumbel = -torch.log(-torch.log(uniform))  # (B, C) float32, Gumbel(0, 1)
    return (scores + gumbel).argmax(-1, keepdim=True)  # (B, 1) int64


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens (B, 1) int64 sampled from ``logits`` (B, V) as ``sampling`` says (no host sync)."""
    scores, ids = candidates(logits, sampling)  # (B, C) float32, (B, C) int64 or None
    choice = draw(scores, generator)  # (B, 1) int64 into the candidates
    return choice if ids is None else ids.gather(-1, choice)  # (B, 1) int64 token ids


def make_generator(device: torch.device | str, seed: int | None) -> torch.Generator:
    """A dedicated generator on ``device``, seeded with ``seed`` (None: from the OS's randomness)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
