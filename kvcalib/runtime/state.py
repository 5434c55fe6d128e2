"""Fitted per-layer state from a recipe's tensors -> the codecs the runtime uses.

Tensor names (``layers.{i}.{k|v}.{name}``):

- ``clip``: clip scale alpha, (H, D) for per-channel keys, (H, 1) otherwise, broadcast over blocks.
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


def build_codecs(recipe: Recipe, configs: list[LayerConfig]) -> list[LayerCodec]:
    """One LayerCodec per layer, carrying the recipe's fitted tensors."""
    return [LayerCodec(cfg, k_clip=_clip(recipe, i, "k"), v_clip=_clip(recipe, i, "v"))
            for i, cfg in enumerate(configs)]
