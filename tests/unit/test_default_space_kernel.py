"""The search offers by default only what the fused kernel decodes (issue 50): every choice the
default space can make, sampled as a search samples it and fitted as a search fits it, has a kernel
path on a head_dim-64 model (each layer's reason from :func:`kvcalib.runtime.triton_path.decode_paths`
is None), 3-bit codes included; a choice without one (non-uniform levels, pre-RoPE keys) stays opt-in
and is named per layer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.conftest import tiny_config, tiny_model

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def objective():
    from kvcalib.collection import collect_stats
    from kvcalib.models import model_info
    from kvcalib.optimize.objective import SearchObjective

    cfg = tiny_config("llama", heads=4, kv_heads=2, head_dim=64)  # the kernel's smallest head_dim for 2-bit planes
    model = tiny_model("llama", config=cfg)
    info = model_info(model.config, "tiny-llama-d64")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 128), generator=g)  # (N, T)
    stats = collect_stats(model, ids, reservoir_blocks=2, block_len=64, name=info.name, progress=False)
    return SearchObjective(model, info, stats, ids[:1], context=256)


def test_every_space_choice_decodes_in_the_kernel(objective):
    """The default space, 3-bit codes included (they joined it once the kernel read them faster than
    bf16: kvcalib/optimize/space.py)."""
    import optuna

    from kvcalib.optimize.space import SearchSpace
    from kvcalib.runtime.triton_path import decode_paths

    space = SearchSpace()
    assert 3 in space.bits
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen_bits, seen_methods = set(), set()
    for _ in range(12):
        point = space.sample(study.ask(), objective.info.num_layers)
        recipe = objective.recipe(point)
        assert decode_paths(recipe, objective.info) == [None] * objective.info.num_layers, point
        seen_bits |= set(point.k_bits) | set(point.v_bits)
        seen_methods |= {m for layer in point.methods for m in layer}
    assert seen_bits == set(space.bits) and seen_methods == set(space.layer_methods)  # the samples covered them


def test_a_space_searched_with_learned_rotations_decodes_in_the_kernel(objective, monkeypatch):
    """``kvcalib search --rotate learned``: the rotate switch fits one (D, D) matrix per side shared by
    the kv heads (the kernel reads it with a head stride of 0), beside clip, on 2- and 3-bit codes:
    the point still decodes in the kernel. The fit runs 8 optimiser steps, not 80: the kernel path
    depends on the matrix stored, not on how far it was optimised (80 took over 30 s here)."""
    import kvcalib.methods.rotate as rotate_mod
    from kvcalib.optimize.objective import SearchObjective, rotation_overrides

    fit = rotate_mod.fit_learned_rotation
    monkeypatch.setattr(rotate_mod, "fit_learned_rotation", lambda *a, **kw: fit(*a, **{**kw, "steps": 8}))
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.runtime.triton_path import decode_paths

    learned = SearchObjective(objective.model, objective.info, objective.stats, objective.ids, context=256,
                              method_overrides=rotation_overrides("learned"))
    floor = SearchSpace().floor_point(objective.info.num_layers)
    assert objective.info.num_layers == 2
    point = replace(floor, k_bits=(2, 3), v_bits=(2, 3), methods=(("rotate", "clip"), ("rotate",)))
    recipe = learned.recipe(point)
    assert decode_paths(recipe, objective.info) == [None] * objective.info.num_layers
    assert any(k.endswith(".rotation") and t.dim() == 2 for k, t in recipe.tensors.items())  # the path under test


@pytest.mark.parametrize("method", ["levels", "prerope", "scale8"])
def test_opt_in_choices_without_a_kernel_path_say_so_per_layer(objective, method):
    """Non-uniform levels, pre-RoPE keys and 8-bit scale pairs run on the reference path only: not in
    the default space, and a recipe that uses them says which layers decode there and why (naming
    the method)."""
    from kvcalib.optimize.space import SearchSpace
    from kvcalib.runtime.triton_path import decode_paths

    assert method not in SearchSpace().layer_methods
    space = SearchSpace(layer_methods=(method,))
    point = space.floor_point(objective.info.num_layers)
    point = replace(point, methods=((method,),) * objective.info.num_layers)
    paths = decode_paths(objective.recipe(point), objective.info)
    assert all(why is not None and f"the kernel does not apply the k side's {method} state" in why
               for why in paths), paths
