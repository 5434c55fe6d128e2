"""Greedy-generation token agreement with full precision, and the greedy decoder the other
generation metrics share.

Definition. For each prompt, generate ``N`` tokens greedily twice: through
:class:`~kvcalib.runtime.cache.CompressedCache` (the recipe) and with the model's ordinary
``DynamicCache`` (full precision). Both runs generate exactly ``N`` tokens (EOS is suppressed
the same way in both, ``min_new_tokens = N``). Then

- ``agreement`` = fraction of the N x prompts positions where the two tokens are equal, compared
  position by position to the end (after a divergence each run continues from its own history,
  so later matches count as they fall);
- ``first_divergence`` = mean over prompts of the index of the first differing token (N when the
  two runs agree everywhere): how long the compressed run stays on the full-precision path.

Prompts are equal-length token windows cut from the evaluation split
(:func:`kvcalib.data.pack_samples`, seeded), so they batch without padding. Make them longer
than the recipe's full-precision window (KIVI keeps 128 tokens) or nothing is ever compressed:
the prompt is prefilled in full precision and compressed right after its own attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvcalib.models import cache_kwarg
from kvcalib.recipe import Recipe


@dataclass(frozen=True)
class AgreementResult:
    agreement: float  # matching positions / all positions
    first_divergence: float  # mean index of the first mismatch (N if none)
    n_prompts: int
    n_tokens: int  # tokens generated per prompt


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, max_new_tokens: int, recipe: Recipe | None = None,
                    batch_size: int = 8, on_batch: Callable[[int], None] | None = None) -> torch.Tensor:
    """Greedy continuations (N, max_new_tokens) of ``prompts`` (N, P) through ``model.generate``.

    ``recipe=None``: full precision (the model's default DynamicCache); otherwise a fresh
    ``CompressedCache.from_recipe(model, recipe)`` per batch. EOS never ends a run early.
    """
    from kvcalib.runtime.cache import CompressedCache

    device = next(model.parameters()).device
    out = []
    for start in range(0, prompts.shape[0], batch_size):
        batch = prompts[start:start + batch_size].to(device)  # (B, P)
        kwargs = {}
        if recipe is not None:
            kwargs[cache_kwarg(model)] = CompressedCache.from_recipe(model, recipe)
        seq = model.generate(
            input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, num_beams=1, top_k=None, top_p=None,
            temperature=None, pad_token_id=_pad_id(model), **kwargs,
        )  # (B, P + max_new_tokens)
        out.append(seq[:, batch.shape[1]:].cpu())  # (B, max_new_tokens)
        if on_batch is not None:
            on_batch(batch.shape[0])
    return torch.cat(out, 0)  # (N, max_new_tokens)


def _pad_id(model) -> int:
    cfg = model.generation_config
    for tok in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(tok, (list, tuple)):
            tok = tok[0] if tok else None
        if tok is not None:
            return int(tok)
    return 0


def agreement_stats(reference: torch.Tensor, candidate: torch.Tensor) -> AgreementResult:
    """Agreement of ``candidate`` (N, T) with ``reference`` (N, T) (see module docstring)."""
    if reference.shape != candidate.shape or reference.dim() != 2:
        raise ValueError(f"token tensors must both be (N, T), got {tuple(reference.shape)} and {tuple(candidate.shape)}")
    n, t = reference.shape
    same = reference == candidate  # (N, T) bool
    diff = ~same
    # index of the first mismatch per row, T where there is none
    first = torch.where(diff.any(1), diff.float().argmax(1), torch.full((n,), t))  # (N,)
    return AgreementResult(agreement=float(same.float().mean()), first_divergence=float(first.float().mean()),
                           n_prompts=n, n_tokens=t)


def agreement(model, prompts: torch.Tensor, recipe: Recipe, max_new_tokens: int,
              reference: torch.Tensor | None = None, batch_size: int = 8,
              on_batch: Callable[[int], None] | None = None) -> AgreementResult:
    """Greedy token agreement of ``recipe`` with full precision over ``prompts`` (N, P).

    ``reference`` (N, max_new_tokens): the full-precision continuations, when already computed
    (the harness computes them once for all recipes).
    """
    if reference is None:
        reference = greedy_generate(model, prompts, max_new_tokens, None, batch_size)
    cand = greedy_generate(model, prompts, max_new_tokens, recipe, batch_size, on_batch)
    return agreement_stats(reference, cand)


# ------------------------------------------------------------------ shared greedy decoder
@torch.no_grad()
def greedy_decode(model, chunks: Sequence[torch.Tensor], max_new_tokens: int, cache=None,
                  stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """Feed ``chunks`` (each (B, T_i)) through ``cache`` one forward each, then decode greedily.

    ``cache=None``: full precision (a fresh ``DynamicCache``). Each chunk is one forward, so with
    a :class:`~kvcalib.runtime.cache.CompressedCache` a chunk's attention sees the earlier
    chunks as the runtime stores them (compressed beyond the window), not in full precision.
    ``stop(new_tokens (B, n))`` ends decoding early when it returns True. Returns (B, n <= max_new_tokens).
    """
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    logits = None
    for chunk in chunks:
        chunk = chunk.to(device)  # (B, T_i)
        # logits_to_keep=1: only the last position's logits (the LM head over a long chunk costs
        # about as much as the rest of a small model)
        logits = model(input_ids=chunk, **{cache_kwarg(model): cache}, use_cache=True,
                       logits_to_keep=1).logits[:, -1]  # (B, V)
    if logits is None:
        raise ValueError("greedy_decode needs at least one chunk")
    new: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        tok = logits.float().argmax(-1, keepdim=True)  # (B, 1)
        new.append(tok)
        if step + 1 == max_new_tokens or (stop is not None and stop(torch.cat(new, 1))):
            break
        logits = model(input_ids=tok, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1]  # (B, V)
    return torch.cat(new, 1).cpu()  # (B, n)


__all__ = ["AgreementResult", "agreement", "agreement_stats", "greedy_decode", "greedy_generate"]
