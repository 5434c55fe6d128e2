"""The shipped default recipes (``recipes/<model>/recipe.safetensors``): each is a copy of one of
its model's long-context recipes beside it (the one its ``report.md`` names), made by a search at
>= 4,096 tokens for that model, and decodes every layer in the fused kernel (issue 51: every
shipped default is a long-context recipe; issue 50: the recipe a user gets is the one that runs
fast). Reads only the committed files: no model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcalib.recipe import Recipe
from kvcalib.runtime.triton_path import decode_paths

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "recipes").glob("*/recipe.safetensors"))


def test_every_model_folder_ships_a_default():
    folders = sorted(p.parent.name for p in SHIPPED)
    assert folders == ["qwen2.5-coder-0.5b", "smollm2-135m"], folders


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_default_is_a_long_context_copy_that_decodes_in_the_kernel(path):
    recipe = Recipe.load(path)
    assert recipe.model is not None and recipe.model.name == path.parent.name
    assert recipe.searched_context is not None and recipe.searched_context >= 4096, recipe.searched_context
    twins = [p.parent.name for p in path.parent.glob("*/recipe.safetensors") if p.read_bytes() == path.read_bytes()]
    assert len(twins) == 1 and twins[0].startswith("long-"), twins
    assert f"[`{twins[0]}`]({twins[0]}/report.md)" in (path.parent / "report.md").read_text()
    paths = decode_paths(recipe, recipe.model)
    assert paths == [None] * len(recipe.layers), paths  # None: the layer decodes in the fused kernel
