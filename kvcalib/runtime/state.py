"""Fitted per-layer state from a recipe's tensors -> the codecs the runtime uses.

Tensor names (``layers.{i}.{k|v}.{name}``):

- ``clip``: clip scale alpha per kv head, (H, 1) (or (H, D)), broadcast over blocks.
- ``perm``: channel permutation per kv head, (H, D) int64 (SKVQ reordering).
- ``center``: scalar, the stored mean's bits (8 or 16), 0 = off (TaDA centering).
- ``kv.outlier_pool``: int64 scalar, OTT pool size P (0 = off); the cache keeps the pools
  (:mod:`kvcalib.runtime.outlier_pool`), the simulation traces them.
- ``kv.schedule``: int64 (N, 3) rows (age, k_bits, v_bits), PATS tiers; its first quantized tier
  must be the layer config (:mod:`kvcalib.runtime.tiers`).

Both ``kv.*`` tensors are read and validated by :meth:`Recipe.outlier_pool` /
:meth:`Recipe.schedule` (a :class:`RecipeError` names the tensor) and handed to each layer's
:class:`LayerCodec`, so the cache, the simulation and the search objective all get them from the
codec. Unknown names are refused, so a recipe from a newer kvcalib cannot be half-applied; a known
name under the wrong side (``k.schedule``, ``kv.clip``) is refused too, instead of being ignored.
"""

from __future__ import annotations

import torch

from kvcalib.errors import RecipeError
from kvcalib.recipe import LayerConfig, Recipe
from kvcalib.runtime.codec import LayerCodec


def _clip(recipe: Recipe, i: int, side: str) -> float | torch.Tensor:
    t = recipe.tensors.get(f"layers.{i}.{side}.clip")
    if t is None:
        return 1.0
    t = t.float()
    if t.numel() and (t.min() <= 0 or t.max() > 1):
        raise RecipeError(f"recipe {recipe.name!r}: layers.{i}.{side}.clip must lie in (0, 1]")
    # stored per (head, channel-or-1); quantizers broadcast over (B, H, groups, D)
    return t[None, :, None, :] if t.dim() == 2 else t


APPLIED = ("clip", "perm", "center", "outlier_pool", "schedule")
# fitted by calibration but only informative at runtime (the search reads them)
INFORMATIVE = ("center_gain", "outlier_gain", "clip_error", "huffman")  # huffman: code lengths (2**bits,) uint8
# names that exist for K and V together only (``layers.{i}.kv.{name}``), and applied names that are per side
KV_ONLY = ("outlier_pool", "schedule", "outlier_gain")
PER_SIDE_APPLIED = ("clip", "perm", "center")


def _perm(recipe: Recipe, i: int, side: str, head_dim: int | None) -> torch.Tensor | None:
    t = recipe.tensors.get(f"layers.{i}.{side}.perm")
    if t is None:
        return None
    ok = t.dim() == 2 and not t.is_floating_point() and bool(
        (torch.sort(t.long(), dim=-1).values == torch.arange(t.shape[-1])).all())
    if not ok or (head_dim is not None and t.shape[-1] != head_dim):
        raise RecipeError(f"recipe {recipe.name!r}: layers.{i}.{side}.perm must be an (H, head_dim) permutation per head")
    return t.long()


def _center(recipe: Recipe, i: int, side: str) -> int:
    t = recipe.tensors.get(f"layers.{i}.{side}.center")
    if t is None:
        return 0
    bits = int(round(float(t.reshape(-1)[0])))
    if bits not in (0, 8, 16):
        raise RecipeError(f"recipe {recipe.name!r}: layers.{i}.{side}.center must be 0, 8 or 16 (mean bits), got {bits}")
    return bits


def check_tensor_names(recipe: Recipe, num_layers: int) -> None:
    """Refuse tensors this runtime would not apply (naming the first)."""
    for name in recipe.tensors:
        parts = name.split(".")
        ok = (len(parts) == 4 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < num_layers
              and parts[2] in ("k", "v", "kv") and parts[3] in APPLIED + INFORMATIVE)
        if not ok:
            raise RecipeError(f"recipe {recipe.name!r} holds tensor {name!r}, which this kvcalib does not apply: "
                              "re-export the recipe with this version")
        side, what = parts[2], parts[3]
        if (what in KV_ONLY and side != "kv") or (what in PER_SIDE_APPLIED and side == "kv"):
            want = "kv" if what in KV_ONLY else "k or v"
            raise RecipeError(f"recipe {recipe.name!r} holds tensor {name!r}: {parts[3]} belongs under "
                              f"layers.{parts[1]}.{want}.{parts[3]}: re-export the recipe")


def build_codecs(recipe: Recipe, configs: list[LayerConfig], head_dim: int | None = None) -> list[LayerCodec]:
    """One LayerCodec per layer, carrying the recipe's fitted tensors."""
    check_tensor_names(recipe, len(configs))
    return [LayerCodec(cfg, k_clip=_clip(recipe, i, "k"), v_clip=_clip(recipe, i, "v"),
                       k_perm=_perm(recipe, i, "k", head_dim), v_perm=_perm(recipe, i, "v", head_dim),
                       k_center=_center(recipe, i, "k"), v_center=_center(recipe, i, "v"),
                       outlier_pool=recipe.outlier_pool(i, cfg), schedule=recipe.schedule(i, cfg))
            for i, cfg in enumerate(configs)]
