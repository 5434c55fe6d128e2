"""kvcalib as an lm-evaluation-harness model: ``--model kvcalib``.

:class:`KvcalibLM` is lm-eval's own :class:`~lm_eval.models.huggingface.HFLM` (its batching,
tokenization, truncation, stop sequences and chat templates) over a model that kvcalib loads
(``pretrained``: an embedded alias, a folder, a hub id or a ``.gguf`` file), with one change:
every ``generate_until`` request runs ``model.generate(..., past_key_values=CompressedCache)``
with a fresh cache built from ``recipe``, exactly as the README's "From Python" does. The prompt
is prefilled with full-precision attention and compressed; each generated token reads the
compressed cache. ``recipe`` unset (or ``none``) is full precision (the model's DynamicCache).

``loglikelihood`` requests run through the compressed cache too: the context in one forward,
then the continuation one teacher-forced token per step (a real decode), one request at a time.
``loglikelihood_rolling`` (whole-document perplexity tasks) is refused: ``kvcalib eval --metrics
ppl`` scores that decode-faithfully at any length.

Importing this module imports lm-eval and registers the model; :mod:`kvcalib.eval.tasks` does it
only when tasks are asked for, so ``import kvcalib`` never needs lm-eval. From the shell, lm-eval's
own command line with the model registered::

    kvcalib-lm-eval --model kvcalib --model_args pretrained=smollm2-135m,recipe=kivi-2 \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths": [4096]}' --limit 50
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from kvcalib.errors import KvcalibError

FULL_PRECISION = ("", "none", "fp", "full")  # recipe= values meaning no compression at all


@register_model("kvcalib")
class KvcalibLM(HFLM):
    """lm-eval's HF model with generation through :class:`~kvcalib.runtime.cache.CompressedCache`."""

    def __init__(self, pretrained: str = "smollm2-135m", recipe: Any = None, device: str | None = None,
                 dtype: str | None = None, batch_size: int | str | None = 1, max_length: int | None = None,
                 loaded: Any = None, **kwargs: Any) -> None:
        from kvcalib.models import load_model

        kwargs.pop("max_batch_size", None)  # lm-eval's command line passes it; one batch size here
        kwargs.pop("tokenizer", None)  # the RULER tasks read it from the model args; the model has its own
        if loaded is None:
            loaded = load_model(str(pretrained), device=device, dtype=dtype)
        self.loaded = loaded
        info = loaded.info
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=int(batch_size or 1),
                         max_length=int(max_length) if max_length else (info.max_positions or None), **kwargs)
        self.recipe = None
        self.set_recipe(recipe)

    def set_recipe(self, recipe: Any) -> None:
        """Use ``recipe`` (a Recipe, a file, a preset name; None or "none": full precision) from
        the next request on; refuses a recipe fitted for another model."""
        from kvcalib.recipe import resolve_recipe

        if recipe is None or (isinstance(recipe, str) and recipe.strip().lower() in FULL_PRECISION):
            self.recipe = None
            return
        rec = resolve_recipe(recipe)
        rec.check_model(self.loaded.info)
        self.recipe = rec

    def _cache_kwargs(self) -> dict[str, Any]:
        """A fresh compressed cache for one generation (empty: full precision)."""
        if self.recipe is None:
            return {}
        from kvcalib.models import cache_kwarg
        from kvcalib.runtime.cache import CompressedCache

        return {cache_kwarg(self.model): CompressedCache.from_recipe(self.model, self.recipe)}

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        # HFLM's generate call, with the compressed cache: a cache holds one generation, so one per call
        return super()._model_generate(context, max_length, stop, **generation_kwargs, **self._cache_kwargs())

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """(log-probability, is-greedy) of each continuation, decoded through the cache (module docstring)."""
        from kvcalib.models import cache_kwarg

        out = []
        for _, context_enc, continuation_enc in requests:
            ids = torch.tensor(context_enc + continuation_enc, dtype=torch.long, device=self.device)[None]  # (1, T)
            ids = ids[:, -(self.max_length + 1):]  # lm-eval's left truncation: the last max_length + 1 tokens
            n_cont = len(continuation_enc)
            prompt = ids[:, :ids.shape[1] - n_cont]  # (1, P)
            if prompt.shape[1] == 0:
                raise KvcalibError("a loglikelihood request with an empty context: kvcalib's lm-eval model needs "
                                   "at least one context token")
            kwargs = self._cache_kwargs()
            if not kwargs:
                from transformers import DynamicCache

                kwargs = {cache_kwarg(self.model): DynamicCache(config=self.model.config)}
            logits = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1, **kwargs).logits[:, -1]  # (1, V)
            total, greedy = 0.0, True
            for step, tok in enumerate(continuation_enc):
                logp = torch.log_softmax(logits.float(), -1)[0]  # (V,)
                total += float(logp[tok])
                greedy = greedy and int(logp.argmax()) == tok
                if step + 1 < n_cont:
                    nxt = torch.tensor([[tok]], device=self.device)  # (1, 1)
                    logits = self.model(input_ids=nxt, use_cache=True, **kwargs).logits[:, -1]  # (1, V)
            out.append((total, greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise KvcalibError("kvcalib's lm-eval model does not run loglikelihood_rolling (whole-document perplexity) "
                           "tasks: score perplexity with `kvcalib eval --metrics ppl`, decode-faithful at any length")


__all__ = ["KvcalibLM"]
