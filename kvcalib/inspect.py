"""``kvcalib inspect``: a recipe as a per-layer report (table or JSON)."""

from __future__ import annotations

from typing import Any

from kvcalib.models import DEFAULT_MODEL, ModelInfo
from kvcalib.recipe import Recipe, layer_bytes, resolve_recipe


def _model_info_for(recipe: Recipe, model: str | None) -> ModelInfo:
    """The recipe's own model, else the geometry of ``model`` (config only, no weights)."""
    if recipe.model is not None and model is None:
        return recipe.model
    from transformers import AutoConfig

    from kvcalib.models import HUB_ALIASES, ensure_embedded_folder, embedded_aliases, model_info

    name = model or DEFAULT_MODEL
    where = str(ensure_embedded_folder(name)) if name in embedded_aliases() else HUB_ALIASES.get(name, name)
    try:
        config = AutoConfig.from_pretrained(where)
    except (OSError, ValueError) as err:
        from kvcalib.errors import KvcalibError

        raise KvcalibError(f"cannot read the config of --model {name!r} ({type(err).__name__}): pass an embedded alias or a local folder.") from None
    return model_info(config, name)


def inspect_recipe(spec: str, model: str | None = None, context: int = 4096) -> dict[str, Any]:
    """Everything `kvcalib inspect` shows, as a JSON-ready dict."""
    recipe = resolve_recipe(spec)
    info = _model_info_for(recipe, model)
    recipe.check_model(info)
    layers = []
    elements_per_layer = 2 * info.num_kv_heads * info.head_dim * context
    for i, cfg in enumerate(recipe.layer_configs(info.num_layers)):
        nbytes = sum(layer_bytes(cfg, info.num_kv_heads, info.head_dim, context, info.sliding_window[i]).values())
        layers.append({"layer": i, **cfg.to_dict(), "sliding_window": info.sliding_window[i],
                       "effective_bits": 8.0 * nbytes / elements_per_layer})
    mem = recipe.memory(info, context)
    return {
        "name": recipe.name,
        "preset": recipe.is_preset,
        "model": info.to_dict(),
        "context": context,
        "layers": layers,
        "memory": {"effective_bits": mem.effective_bits, "total_bytes": mem.total_bytes,
                   "components": mem.components},
        "tensors": {k: list(v.shape) for k, v in recipe.tensors.items()},
        "provenance": recipe.provenance,
    }
