"""Passkey retrieval: a 5-digit key buried at a given depth of filler text, asked for at the end.

Prompt, exactly ``length`` tokens (token-level construction, so depths are exact)::

    [BOS] INTRO  filler[:a]  NEEDLE  filler[a:F]  QUESTION
    NEEDLE   = " The pass key is 12345. Remember it. 12345 is the pass key. "
    QUESTION = "\\n\\nWhat is the pass key? The pass key is"

``F`` filler tokens fill the rest of the length; ``a = round(depth * F)``, so ``depth`` is the
fraction of the filler that precedes the needle (0 = right after the intro, 1 = right before the
question). Filler = consecutive tokens of a long document (the Britannica article, ``longtext``)
from a seeded random offset (wrapping around if needed); keys are seeded 5-digit numbers.

Modes (how the prompt reaches the cache):

- ``split`` (default): the context (everything before QUESTION) is one forward, optionally in
  chunks of ``chunk_tokens``; then QUESTION is a second forward; then greedy decoding. The
  runtime flushes right after each attention call (``CompressedLayer.flush`` from
  ``kvcalib_attention``), so after the context forward all of it but the most recent
  ``window .. window + block - 1`` tokens sits in packed storage, and the question's attention
  reads the context *compressed*: the retrieval depends on the recipe, as in a chat turn that
  arrives after a long document was cached.
- ``prefill``: the whole prompt is one forward. Prefill attention runs on full-precision K/V
  (it always does), so the question sees the context uncompressed and only the generated tokens
  read compressed K/V: a lenient upper bound.

A trial is correct when the first number in the greedy continuation (``max_new_tokens`` tokens)
equals the key. Prompts of one length are equal-length, so they run as one batch.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvcalib.recipe import Recipe

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
MODES = ("split", "prefill")


@dataclass(frozen=True)
class PasskeyPrompt:
    """One trial's prompt. ``ids`` (length,) = context (``context_tokens``) + question."""

    ids: torch.Tensor  # (length,) LongTensor
    context_tokens: int  # tokens before QUESTION (fed first in split mode)
    key: str
    length: int
    depth: float
    needle_start: int  # index of the needle's first token in ids
    needle_tokens: int
    filler_tokens: int  # F


@dataclass(frozen=True)
class PasskeyResult:
    accuracy: float  # correct / trials, over all lengths and depths
    by_cell: dict[str, float]  # "length@depth" -> accuracy
    outputs: list[str]  # decoded continuation per trial, in prompt order
    n_trials: int


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def extract_passkey(text: str) -> str | None:
    """The first run of digits in ``text`` (the model's answer), or None."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def build_passkey_prompt(tokenizer, filler_ids: Sequence[int], length: int, depth: float, key: str,
                         offset: int = 0) -> PasskeyPrompt:
    """A prompt of exactly ``length`` tokens with the needle at ``depth`` (see module docstring)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    if not filler_ids:
        raise ValueError("filler text is empty")
    bos = getattr(tokenizer, "bos_token_id", None)
    head = ([bos] if bos is not None else []) + _encode(tokenizer, INTRO)
    needle = _encode(tokenizer, NEEDLE.format(key=key))
    question = _encode(tokenizer, QUESTION)
    n_fill = length - len(head) - len(needle) - len(question)
    if n_fill < 1:
        fixed = length - n_fill
        raise ValueError(f"passkey length {length} is too short: its fixed text alone takes {fixed} "
                         f"tokens; use at least {fixed + 1}")
    filler = [filler_ids[(offset + i) % len(filler_ids)] for i in range(n_fill)]
    a = round(depth * n_fill)
    context = head + filler[:a] + needle + filler[a:]
    ids = torch.tensor(context + question, dtype=torch.long)  # (length,)
    return PasskeyPrompt(ids, len(context), key, length, depth, len(head) + a, len(needle), n_fill)


def build_passkey_prompts(tokenizer, filler_text: str, lengths: Sequence[int], depths: Sequence[float],
                          trials: int, seed: int = 0) -> list[PasskeyPrompt]:
    """``trials`` prompts per (length, depth), ordered by length, then depth, then trial; seeded."""
    filler_ids = _encode(tokenizer, filler_text)
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key = str(rng.randint(10000, 99999))
                offset = rng.randrange(len(filler_ids))
                prompts.append(build_passkey_prompt(tokenizer, filler_ids, length, depth, key, offset))
    return prompts


@torch.no_grad()
def run_passkey(model, tokenizer, prompts: Sequence[PasskeyPrompt], recipe: Recipe | None = None,
                mode: str = "split", chunk_tokens: int = 0, max_new_tokens: int = 10,
                batch_size: int = 8, on_batch: Callable[[int], None] | None = None) -> PasskeyResult:
    """Accuracy of ``recipe`` (None = full precision, DynamicCache) on ``prompts``.

    ``mode``/``chunk_tokens``: see the module docstring; ``chunk_tokens=0`` feeds the context in
    one forward. Prompts of equal length are batched, ``batch_size`` at a time.
    """
    from kvcalib.eval.agreement import greedy_decode
    from kvcalib.runtime.cache import CompressedCache

    if mode not in MODES:
        raise ValueError(f"passkey mode must be one of {MODES}, got {mode!r}")
    outputs: list[str | None] = [None] * len(prompts)
    # equal-length prompts batch without padding; indices restore the prompt order
    groups: dict[tuple[int, int], list[int]] = {}  # (length, context tokens) -> prompt indices
    for i, p in enumerate(prompts):
        groups.setdefault((p.ids.shape[0], p.context_tokens), []).append(i)
    for idx in groups.values():
        for start in range(0, len(idx), batch_size):
            part = idx[start:start + batch_size]
            ids = torch.stack([prompts[i].ids for i in part])  # (B, length)
            ctx = prompts[part[0]].context_tokens
            if mode == "prefill":
                chunks = [ids]
            else:
                step = chunk_tokens if chunk_tokens > 0 else ctx
                chunks = [ids[:, s:min(s + step, ctx)] for s in range(0, ctx, step)] + [ids[:, ctx:]]
            cache = CompressedCache.from_recipe(model, recipe) if recipe is not None else None
            new = greedy_decode(model, chunks, max_new_tokens, cache)  # (B, n)
            for row, i in enumerate(part):
                outputs[i] = tokenizer.decode(new[row], skip_special_tokens=True)
            if on_batch is not None:
                on_batch(len(part))
    correct = [extract_passkey(o or "") == p.key for o, p in zip(outputs, prompts)]
    cells: dict[str, list[bool]] = {}
    for ok, p in zip(correct, prompts):
        cells.setdefault(f"{p.length}@{p.depth:g}", []).append(ok)
    return PasskeyResult(
        accuracy=sum(correct) / max(len(correct), 1),
        by_cell={k: sum(v) / len(v) for k, v in cells.items()},
        outputs=[o or "" for o in outputs],
        n_trials=len(prompts),
    )


__all__ = ["MODES", "PasskeyPrompt", "PasskeyResult", "build_passkey_prompt", "build_passkey_prompts",
           "extract_passkey", "run_passkey"]
