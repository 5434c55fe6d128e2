"""Offline calibration: per layer and K|V, fit the recipe tensors of the five methods.

Each method is one :class:`~kvcalib.calibrate.base.CalibrationMethod` subclass in its own
module, registered in :data:`METHODS` (insertion order = pipeline order, because later steps
use what earlier ones fitted):

=========  ==========================  ==================================================
name       module                      tensors (per layer, ``layers.{i}.`` prefix on export)
=========  ==========================  ==================================================
center     :mod:`.center` (TaDA)       ``k.center``/``v.center`` float32 (): mean bits 8|16, 0 = off;
                                       ``k.center_gain``/``v.center_gain`` float32 ()
reorder    :mod:`.reorder` (SKVQ)      ``v.perm`` int64 (H, D); ``k.perm`` int64 (H, D) (k_axis='token')
clip       :mod:`.clip` (SKVQ)         ``k.clip``/``v.clip`` float32 (H, 1), alpha in (0, 1]
outliers   :mod:`.outliers` (OTT)      ``kv.outlier_pool`` int64 (); ``kv.outlier_gain`` float32 ()
schedule   :mod:`.schedule` (PATS)     ``kv.schedule`` int64 (N, 3): (age, k_bits, v_bits)
=========  ==========================  ==================================================

What the runtime must do with each tensor is stated in each module's docstring ("Runtime
contract"). Every step is pure and seeded; the pure fitting functions
(:func:`~.reorder.fit_channel_permutation`, :func:`~.clip.fit_clip_alpha`,
:func:`~.center.fit_centering_gain`, :func:`~.outliers.select_outliers`, :mod:`.schedule`)
can be used without the classes.

Importing this package imports torch but not scikit-learn or scipy (imported inside the
KMeans fit only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvcalib.calibrate.base import CalibrationError, CalibrationMethod
from kvcalib.calibrate.center import CenterMethod
from kvcalib.calibrate.clip import ClipMethod
from kvcalib.calibrate.outliers import OutlierMethod
from kvcalib.calibrate.reorder import ReorderMethod
from kvcalib.calibrate.schedule import ScheduleMethod
from kvcalib.recipe import LayerConfig
from kvcalib.stats import CollectedStats, LayerStats

__all__ = ["METHODS", "CalibrationError", "CalibrationMethod", "build_methods", "fit_layer", "fit_stats"]

# name -> class; the order is the pipeline order (center before reorder/clip, which use it)
METHODS: dict[str, type[CalibrationMethod]] = {
    cls.name: cls for cls in (CenterMethod, ReorderMethod, ClipMethod, OutlierMethod, ScheduleMethod)
}


def build_methods(names: Iterable[str | CalibrationMethod]) -> list[CalibrationMethod]:
    """Instances (default configuration for names) in pipeline order; unknown names are refused."""
    items = list(names)
    out: dict[str, CalibrationMethod] = {}
    for item in items:
        if isinstance(item, CalibrationMethod):
            out[item.name] = item
        elif item in METHODS:
            out[item] = METHODS[item]()
        else:
            raise CalibrationError(f"unknown calibration method {item!r}: use one of {', '.join(METHODS)}")
    if len(out) != len(items):
        raise CalibrationError(f"calibration methods listed twice: {[getattr(i, 'name', i) for i in items]}")
    return [out[name] for name in METHODS if name in out]


def fit_layer(
    layer_stats: LayerStats,
    layer_cfg: LayerConfig,
    methods: Sequence[str | CalibrationMethod] = tuple(METHODS),
    seed: int = 0,
    *,
    heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run the steps on one layer, in pipeline order; unprefixed tensor names (``"v.perm"``...)."""
    fitted: dict[str, torch.Tensor] = {}
    for method in build_methods(methods):
        fitted.update(method.fit(layer_stats, layer_cfg, seed, fitted, heads=heads, head_dim=head_dim))
    return fitted


def fit_stats(
    stats: CollectedStats,
    configs: Sequence[LayerConfig],
    methods: Sequence[str | CalibrationMethod] = tuple(METHODS),
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
