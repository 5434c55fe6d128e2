"""The Python API re-exported by ``kvcalib``: thin typed wrappers over the library functions.

Each wrapper accepts either a config object (``CollectConfig``, ``EvalConfig``) or the config's
fields as keyword arguments, or both (the keywords then override the config's fields; the config
validates again). Nothing here does work of its own: ``collect`` calls
:func:`kvcalib.collection.collect`, ``evaluate`` calls :func:`kvcalib.eval.harness.evaluate`.

Importing this module loads no model, imports no triton/optuna/scikit-learn and initialises no
CUDA; the heavy modules load inside the calls.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from kvcalib.collection import CollectConfig, CollectResult
    from kvcalib.eval.harness import EvalConfig, EvalResult
    from kvcalib.models import LoadedModel
    from kvcalib.recipe import Recipe

__all__ = ["collect", "evaluate", "load_recipe"]

_C = TypeVar("_C")


def _build_config(cls: type[_C], config: _C | None, given: dict[str, Any], what: str) -> _C:
    """``config`` with the non-None ``given`` fields applied (validated by the dataclass)."""
    given = {k: v for k, v in given.items() if v is not None}
    if config is None:
        return cls(**given)
    if not isinstance(config, cls):
        raise TypeError(f"{what}: config must be a {cls.__name__}, got {type(config).__name__}")
    return dataclasses.replace(config, **given) if given else config


def load_recipe(path_or_preset: str | Path) -> "Recipe":
    """Load and validate a recipe file (``.safetensors``/``.json``) or a preset by name.

    Same as :meth:`kvcalib.Recipe.load`. Raises :class:`kvcalib.RecipeError` (a
    :class:`kvcalib.KvcalibError`) naming the field at fault for a corrupt, foreign or
    wrong-version file.

    Example::

        >>> import kvcalib
        >>> recipe = kvcalib.load_recipe("kivi-2")
        >>> recipe.default_layer.k_bits, recipe.default_layer.window
        (2, 128)
    """
    from kvcalib.recipe import Recipe

    return Recipe.load(path_or_preset)


def collect(
    config: "CollectConfig | None" = None,
    *,
    out: str | Path | None = None,
    loaded: "LoadedModel | None" = None,
    model: str | None = None,
    data: str | None = None,
    split: str | None = None,
    text_field: str | None = None,
    samples: int | None = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    reservoir_blocks: int | None = None,
    block_len: int | None = None,
    seed: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool | None = None,
) -> "CollectResult":
    """Record K/V statistics of ``model`` on calibration text into the run folder ``out``.

    Pass a :class:`~kvcalib.collection.CollectConfig`, its fields as keywords, or both (keywords
    win; ``None`` means "the config's value"). ``loaded`` reuses an already loaded model
    (:func:`kvcalib.load_model`) instead of loading ``model`` again. ``out`` must not exist or be
    empty (run folders are never overwritten); default ``artifacts/runs/collect-<time>``.

    Writes ``out/stats.safetensors`` (per layer and K|V: ``count`` (), ``min``/``max``/``mean``/
    ``absmax``/``sq_mean`` (H_kv, D) float32; reservoir blocks ``k``/``v`` (NB, BL, H_kv, D) and
    ``q`` (NB, BL, H_q, D) float16) and ``out/run.json`` (resolved config, versions, seed).

    Returns the typed :class:`~kvcalib.collection.CollectResult`: ``out_dir``, ``stats``
    (:class:`~kvcalib.stats.CollectedStats`), ``n_samples``, ``n_tokens``, ``wall_seconds`` and a
    per-layer ``summary``.

    Example (embedded model, a few seconds on a CPU)::

        >>> import kvcalib
        >>> run = kvcalib.collect(model="smollm2-135m", data="embedded", samples=2, seq_len=64,
        ...                       block_len=32, out="runs/smol", device="cpu")  # doctest: +SKIP
        >>> run.stats.layers[0].k["absmax"].shape  # (H_kv, D)  # doctest: +SKIP
        torch.Size([3, 64])
    """
    from kvcalib.collection import CollectConfig
    from kvcalib.collection import collect as run_collect

    cfg = _build_config(CollectConfig, config, dict(
        model=model, data=data, split=split, text_field=text_field, samples=samples, seq_len=seq_len,
        batch_size=batch_size, reservoir_blocks=reservoir_blocks, block_len=block_len, seed=seed,
        device=device, dtype=dtype, trust_remote_code=trust_remote_code), "collect")
    if loaded is not None and config is None and model is None:
        cfg = dataclasses.replace(cfg, model=loaded.source)  # record the model actually used
    if out is None:
        from kvcalib.paths import default_run_dir

        out = default_run_dir("collect")
    return run_collect(cfg, Path(out), loaded=loaded)


def evaluate(
    config: "EvalConfig | None" = None,
    *,
    loaded: "LoadedModel | None" = None,
    recipes: "str | Path | Recipe | Sequence[str | Path | Recipe] | None" = None,
    model: str | None = None,
    data: str | None = None,
    metrics: str | Sequence[str] | None = None,
    context_len: int | None = None,
    ppl_samples: int | None = None,
    ppl_seq_len: int | None = None,
    agreement_prompts: int | None = None,
    agreement_prompt_len: int | None = None,
    agreement_tokens: int | None = None,
    passkey_lengths: Sequence[int] | None = None,
    passkey_depths: Sequence[float] | None = None,
    passkey_trials: int | None = None,
    gsm8k_limit: int | None = None,
    seed: int | None = None,
    batch_size: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> "list[EvalResult]":
    """Evaluate recipes side by side on identical held-out inputs (``kvcalib eval``).

    ``recipes``: recipe files, preset names (``fp16``, ``kivi-2``, ...) or
    :class:`~kvcalib.Recipe` objects (one or a list). Pass an
    :class:`~kvcalib.eval.harness.EvalConfig`, its fields as keywords, or both (keywords win);
    the other ``EvalConfig`` fields keep their defaults. ``loaded`` reuses a loaded model.

    Returns one :class:`~kvcalib.eval.harness.EvalResult` per recipe, in order: ``ppl``,
    ``ppl_fp``, ``ppl_delta_pct``, ``agreement``, ``passkey``, ``gsm8k`` (``None`` where the metric
    was not run), ``effective_bits`` and ``kv_bytes`` per sequence at ``context_len``.

    Example (embedded model, CPU)::

        >>> import kvcalib
        >>> rows = kvcalib.evaluate(recipes=["kivi-4", "kivi-2"], metrics="ppl", ppl_samples=2,
        ...                         ppl_seq_len=256, device="cpu")  # doctest: +SKIP
        >>> [(r.name, round(r.effective_bits, 2)) for r in rows]  # doctest: +SKIP
    """
    from kvcalib.eval.harness import EvalConfig
    from kvcalib.eval.harness import evaluate as run_evaluate

    if isinstance(recipes, (str, Path)) or (recipes is not None and not isinstance(recipes, Sequence)):
        recipes = [recipes]  # type: ignore[list-item]
    given: dict[str, Any] = dict(
        recipes=list(recipes) if recipes is not None else None, model=model, data=data,
        metrics=metrics, context_len=context_len, ppl_samples=ppl_samples, ppl_seq_len=ppl_seq_len,
        agreement_prompts=agreement_prompts, agreement_prompt_len=agreement_prompt_len,
        agreement_tokens=agreement_tokens,
        passkey_lengths=tuple(passkey_lengths) if passkey_lengths is not None else None,
        passkey_depths=tuple(passkey_depths) if passkey_depths is not None else None,
        passkey_trials=passkey_trials, gsm8k_limit=gsm8k_limit, seed=seed, batch_size=batch_size,
        device=device, dtype=dtype)
    if loaded is not None and config is None and model is None:
        given["model"] = loaded.source
    cfg = _build_config(EvalConfig, config, given, "evaluate")
    return run_evaluate(cfg, loaded=loaded)
