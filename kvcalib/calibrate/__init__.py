"""Offline calibration: per layer and K|V, fit the recipe tensors of the chosen methods.

The methods are the registry of :mod:`kvcalib.methods` (one module each, in pipeline order:
later methods fit on what earlier ones fitted, e.g. clipping on permuted, centred data). This
phase runs them over collected statistics: :func:`fit_layer` for one layer, :func:`fit_stats`
for all layers (``{"layers.{i}.{name}": tensor}``, ready for ``Recipe.tensors``), and
:func:`finish_recipe` for the methods that work on the whole fitted recipe (Huffman codebooks).

Importing this package imports torch but not scikit-learn or scipy (imported inside the
KMeans fit only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvcalib.codec import LayerCodec
from kvcalib.layout import LayerConfig
from kvcalib.methods import CalibrationError, Method, registry
from kvcalib.methods.base import FitContext
from kvcalib.stats import CollectedStats, LayerStats

__all__ = ["CalibrationError", "Method", "build_methods", "fit_layer", "fit_stats", "finish_recipe",
           "default_methods"]


def default_methods() -> tuple[str, ...]:
    """The methods a fit runs when none are named: every registered method that works layer by
    layer, in pipeline order (not those applied only to a finished, chosen recipe:
    ``Method.search == "chosen"``, e.g. Huffman codebooks)."""
    return tuple(name for name, m in registry().items() if m.search != "chosen")


def build_methods(names: Iterable[str | Method]) -> list[Method]:
    """Instances (default configuration for names) in pipeline order; unknown names are refused."""
    methods = registry()
    items = list(names)
    out: dict[str, Method] = {}
    for item in items:
        if isinstance(item, Method):
            out[item.name] = item
        elif item in methods:
            out[item] = methods[item]()
        else:
            raise CalibrationError(f"unknown calibration method {item!r}: use one of {', '.join(methods)}")
    if len(out) != len(items):
        raise CalibrationError(f"calibration methods listed twice: {[getattr(i, 'name', i) for i in items]}")
    return [out[name] for name in methods if name in out]


def fit_layer(
    layer_stats: LayerStats,
    layer_cfg: LayerConfig,
    methods: Sequence[str | Method] | None = None,
    seed: int = 0,
    *,
    heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run the methods (default: :func:`default_methods`, default configuration) on one layer, in
    pipeline order, each on the statistics as the earlier ones left them
    (:meth:`~kvcalib.methods.base.Method.transform_stats`: e.g. clip scales fitted on the rotated
    reservoir); unprefixed tensor names (``"v.perm"``...)."""
    if methods is None:
        methods = default_methods()
    fitted: dict[str, torch.Tensor] = {}
    context = FitContext(fitted, codec=lambda tensors: LayerCodec.from_tensors(layer_cfg, tensors, heads, head_dim))
    for method in build_methods(methods):
        mine = method.fit(layer_stats, layer_cfg, seed, heads=heads, head_dim=head_dim, context=context)
        fitted.update(mine)
        layer_stats = method.transform_stats(layer_stats, mine)  # what the later methods fit on
    return fitted


def fit_stats(
    stats: CollectedStats,
    configs: Sequence[LayerConfig],
    methods: Sequence[str | Method] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """All layers: ``{"layers.{i}.{name}": tensor}``, ready for ``Recipe.tensors``.

    The statistics' geometry is checked against the model they record (``stats.model``).
    """
    if len(configs) != len(stats.layers):
        raise CalibrationError(
            f"{len(configs)} layer configs for statistics of {len(stats.layers)} layers: statistics from another model?"
        )
    out: dict[str, torch.Tensor] = {}
    for i, (layer, cfg) in enumerate(zip(stats.layers, configs)):
        try:
            tensors = fit_layer(layer, cfg, methods, seed, heads=stats.model.num_kv_heads,
                                head_dim=stats.model.head_dim)
        except CalibrationError as err:
            raise CalibrationError(f"layer {i}: {err}") from None
        out.update({f"layers.{i}.{name}": t for name, t in tensors.items()})
    return out


def finish_recipe(recipe, stats: CollectedStats, methods: Sequence[str | Method]):
    """``recipe`` after every method's whole-recipe step (:meth:`~kvcalib.methods.base.Method.finish`),
    in pipeline order."""
    for method in build_methods(methods):
        recipe = method.finish(recipe, stats)
    return recipe
